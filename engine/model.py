"""A Llama-family decoder over the paged KV cache: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Built for a fast CPU decode: q/k/v and gate/up are each one matmul, the per-step attention plan
and RoPE tables are computed once per forward, and each layer is a short run of tensor ops.
In fp32 without quantization it reproduces transformers' LlamaForCausalLM token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import AttentionMetadata, AttentionPlan, paged_attend, prepare_attention
from engine.config import ModelConfig
from engine.gguf_linear import GGUFBlocks, GGUFLinear, concat_blocks, with_blocks
from engine.quant import Quantization, make_linear
from kernels import cpu_causal_attention, cpu_decode, cpu_greedy_head
from kernels.cpu_argmax import argmax_rows
from kernels.paged_attention import token_layout


def rope_tables(config: ModelConfig, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin per position, [max_pos, head_dim] fp32, computed as transformers does."""
    d = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    )
    pos = torch.arange(config.max_position_embeddings, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, d]
    return emb.cos(), emb.sin()


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Tensor],  # this layer's HF-named tensors, prefix stripped
        *,
        dtype: torch.dtype,
        quantization: Quantization | None,
        batch_invariant: bool = False,
        blocks: dict[str, GGUFBlocks] | None = None,  # this layer's GGUF blocks (fp32 decode)
        amx: bool = False,  # prefill's Q4_1 GEMMs on AMX tiles, where they run (gguf_linear.py)
    ) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.ffn_size, self.eps = c.intermediate_size, c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        attn, mlp = "self_attn.", "mlp."
        qkv = torch.cat([weights[f"{attn}{n}_proj.weight"] for n in "qkv"])  # [q+2kv, hidden]
        gate_up = torch.cat([weights[f"{mlp}gate_proj.weight"], weights[f"{mlp}up_proj.weight"]])
        lin = {"dtype": dtype, "quantization": quantization, "batch_invariant": batch_invariant}
        b = blocks or {}
        qkv_blocks = concat_blocks([b.get(f"{attn}{n}_proj.weight") for n in "qkv"])
        gate_up_blocks = concat_blocks([b.get(f"{mlp}{n}_proj.weight") for n in ("gate", "up")])
        inv = batch_invariant
        self.qkv_proj = with_blocks(make_linear(qkv, **lin), qkv_blocks, inv, amx)
        o_blocks, down_blocks = b.get(f"{attn}o_proj.weight"), b.get(f"{mlp}down_proj.weight")
        o_proj = make_linear(weights[f"{attn}o_proj.weight"], **lin)
        self.o_proj = with_blocks(o_proj, o_blocks, inv, amx)
        self.gate_up_proj = with_blocks(make_linear(gate_up, **lin), gate_up_blocks, inv, amx)
        down = make_linear(weights[f"{mlp}down_proj.weight"], **lin)
        self.down_proj = with_blocks(down, down_blocks, inv, amx)
        self.input_norm = nn.Parameter(weights["input_layernorm.weight"].to(dtype), False)
        self.post_attn_norm = nn.Parameter(
            weights["post_attention_layernorm.weight"].to(dtype), False
        )

    def forward(
        self,
        x: Tensor,  # [T, hidden] residual stream
        cos: Tensor,  # [T, 1, head_dim]
        sin: Tensor,  # [T, 1, head_dim], sign of the first half folded in
        kv_cache: tuple[Tensor, Tensor],
        plan: AttentionPlan,
    ) -> Tensor:
        t, hd, half = x.shape[0], self.head_dim, self.head_dim // 2
        h = F.rms_norm(x, x.shape[-1:], self.input_norm, self.eps)
        qkv = self.qkv_proj.forward(h)  # [T, (H + 2 KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, hd)  # [T, H + KVH, D]
        # RoPE, rotate-half form: x * cos + cat(x2, x1) * [-sin, sin]. The elementwise steps
        # below write into tensors this layer made (the same operations, so the same bits):
        # fresh multi-MB temporaries cost a 512-token prefill more than their arithmetic
        rotated = torch.cat([qk[..., half:], qk[..., :half]], dim=-1).mul_(sin)
        qk = (qk * cos).add_(rotated)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, hd)
        o = paged_attend(q, k, v, kv_cache, plan, self.scale)  # [T, H, D]
        x = self.o_proj.forward(o.reshape(t, self.q_size)).add_(x)  # x + o: the same sum
        h = F.rms_norm(x, x.shape[-1:], self.post_attn_norm, self.eps)
        gate_up = self.gate_up_proj.forward(h)  # [T, 2 * ffn]
        h = F.silu(gate_up[:, : self.ffn_size], inplace=True) * gate_up[:, self.ffn_size :]
        return self.down_proj.forward(h).add_(x)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Tensor],  # HF names (model.layers.{i}.self_attn.q_proj.weight, ...)
        *,
        dtype: torch.dtype,
        device: torch.device,
        quantization: Quantization | None = None,
        batch_invariant: bool = False,  # row-count-free linears and attention (engine/loader.py)
        blocks: dict[str, GGUFBlocks] | None = None,  # GGUF blocks by HF name (gguf_linear.py)
        fused_decode: bool = True,  # steps of <= 32 tokens in one C call (kernels/cpu_decode.py)
        screened_head: bool = True,  # greedy rows' tokens via kernels/cpu_greedy_head.py
        amx_prefill: bool = True,  # steps past 32 rows on AMX tiles where they run
    ) -> None:
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, device
        self.quantization, self.batch_invariant = quantization, batch_invariant
        embed = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        self.embed_tokens = nn.Parameter(embed.to(dtype), requires_grad=False)
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            own = {k[len(prefix) :]: w for k, w in weights.items() if k.startswith(prefix)}
            own_blocks = {
                k[len(prefix) :]: v for k, v in (blocks or {}).items() if k.startswith(prefix)
            }
            self.layers.append(
                DecoderLayer(
                    config,
                    own,
                    dtype=dtype,
                    quantization=quantization,
                    batch_invariant=batch_invariant,
                    blocks=own_blocks,
                    amx=amx_prefill,
                )
            )
        self.norm = nn.Parameter(weights["model.norm.weight"].to(dtype), requires_grad=False)
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        head = weights[head_name]
        # The head stays at 8 bits under int4: int4 there (of a Q8_0 embedding) changed greedy
        # continuations within a few tokens, int4 layers with an 8-bit head kept them.
        head_quant = {"int4": "int8", "int4-decode": "int8-decode"}.get(quantization, quantization)
        self.lm_head = with_blocks(
            make_linear(
                head, dtype=dtype, quantization=head_quant, batch_invariant=batch_invariant
            ),
            (blocks or {}).get(head_name),
            batch_invariant,
        )
        if batch_invariant and dtype == torch.float32:
            dense = [
                name
                for name, m in self.named_modules()
                if name.endswith(("_proj", "lm_head")) and not isinstance(m, GGUFLinear)
            ]
            if dense:
                raise ValueError(
                    f"batch_invariant=True in float32 runs every linear on the GGUF file's Q4_1 / "
                    f"Q8_0 blocks; {len(dense)} have none (e.g. {dense[:3]}): use dtype 'bfloat16' "
                    "for this model"
                )
        cos, sin = rope_tables(config, device)
        half = config.head_dim // 2
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.register_buffer("rope_cos", cos.to(dtype).contiguous(), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype).contiguous(), persistent=False)
        self.fused = self._fused_decode() if fused_decode and not batch_invariant else None
        # fp32 on GGUF blocks (the default engine): a prefill chunk with nothing cached before
        # it attends through the compiled causal kernel (1.4-1.9x SDPA at 512 tokens); the dense
        # fp32 path keeps SDPA, transformers' kernel
        self.causal_kernel = (
            dtype == torch.float32
            and device.type == "cpu"
            and not batch_invariant
            and any(isinstance(m, GGUFLinear) for m in self.layers.modules())
            and cpu_causal_attention.available()
        )
        self.greedy_head = self._screened_head() if screened_head else None

    def _screened_head(self) -> cpu_greedy_head.ScreenedHead | None:
        """The int8 screen over the LM head's blocks, where it applies and pays: an fp32 head on
        the CPU's Q8_0 blocks, and the kernel's AVX-512 VNNI build."""
        head = self.lm_head
        if self.dtype != torch.float32 or self.device.type != "cpu":
            return None
        if not isinstance(head, GGUFLinear) or head.kind != "q8_0" or not cpu_greedy_head.fast():
            return None
        try:
            return cpu_greedy_head.ScreenedHead(head.blocks)
        except ValueError:  # a block's scale that is not finite: its logits are not either
            return None

    def _fused_decode(self) -> cpu_decode.DecodeForward | None:
        """The fused decode forward over every layer's GGUF blocks, where it applies: fp32 on
        the CPU, every linear on blocks, a shape and a build the kernel takes."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            return None
        linears = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        layers = []
        for layer in self.layers:
            mods = [getattr(layer, n) for n in linears]
            if not all(isinstance(m, GGUFLinear) for m in mods):
                return None
            lins = [cpu_decode.Linear(m.blocks, m.kind) for m in mods]
            layers.append(
                cpu_decode.LayerWeights(*lins, layer.input_norm.data, layer.post_attn_norm.data)
            )
        c = self.config
        shape = cpu_decode.Shape(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.rms_norm_eps,
        )  # fmt: skip
        if shape.refusal() or not cpu_decode.available():
            return None
        return cpu_decode.DecodeForward(shape, layers)

    def decode_counters(self) -> cpu_decode.Counters:
        """The fused decode forward's waits and redone items (all zero without it)."""
        return cpu_decode.counters() if self.fused is not None else cpu_decode.Counters()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, Tensor]],  # per layer, each [blocks, block_size, KVH, D]
        attn: AttentionMetadata,
    ) -> Tensor:
        """The last layer's residual stream [T, hidden]; compute_logits applies the final norm."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.config.num_layers} layers")
        fused = self.fused is not None and input_ids.device.type == "cpu"
        if fused and input_ids.shape[0] <= cpu_decode.MAX_ROWS:
            seq_idx, ctx_len = token_layout(attn.query_lens_cpu, attn.seq_lens_cpu, self.device)
            return self.fused.forward(
                F.embedding(input_ids, self.embed_tokens),  # [T, hidden], updated in place
                self.rope_cos,
                self.rope_sin,
                positions.contiguous(),
                attn.slot_mapping.to(torch.int64).contiguous(),
                kv_caches,
                attn.block_tables.to(torch.int32).contiguous(),
                seq_idx,
                ctx_len,
            )
        plan = prepare_attention(
            attn,
            self.device,
            self.dtype,
            per_token=self.batch_invariant,
            causal_kernel=self.causal_kernel,
        )
        x = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer.forward(x, cos, sin, kv_cache, plan)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[n, hidden] rows of forward()'s output -> [n, vocab] float32 logits."""
        h = F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.config.rms_norm_eps)
        return self.lm_head.forward(h).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: Tensor) -> Tensor:
        """[n] int64: argmax_rows(compute_logits(hidden)), the same tokens; steps of MIN_ROWS
        to MAX_ROWS rows through the screened head where there is one."""
        h = F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.config.rms_norm_eps)
        head, rows = self.greedy_head, h.shape[0]
        if head is not None and cpu_greedy_head.MIN_ROWS <= rows <= cpu_greedy_head.MAX_ROWS:
            tokens = head.argmax(h)
            if tokens is not None:
                return tokens
        return argmax_rows(self.lm_head.forward(h).float())
