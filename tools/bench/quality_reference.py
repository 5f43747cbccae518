"""The fp32 reference of the quality set: a plain Llama forward over a whole segment at once.

No KV cache, no paging, no chunking: dense fp32 matmuls and torch's causal SDPA, written apart
from engine/model.py so that the engine's own paths are measured against something they do not
share. It is the computation transformers' LlamaForCausalLM does (rotate-half RoPE, GQA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import ModelConfig


class ReferenceLlama:
    def __init__(self, config: ModelConfig, weights: dict[str, Tensor]) -> None:
        self.config = config
        self.w = {k: v.float() for k, v in weights.items()}  # HF names, [out, in]
        if config.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        d = config.head_dim
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2).float() / d)  # [d/2]
        self.inv_freq = inv_freq

    def _norm(self, x: Tensor, name: str) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.config.rms_norm_eps) * self.w[name]

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> Tensor:
        """fp32 logits [T, vocab] of every position of one sequence."""
        c, w = self.config, self.w
        t, hd = len(token_ids), c.head_dim
        x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]  # [T, hidden]
        freqs = torch.arange(t).float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[None], emb.sin()[None]  # [1, T, D]

        def rope(u: Tensor) -> Tensor:  # [heads, T, D]
            rotated = torch.cat([-u[..., hd // 2 :], u[..., : hd // 2]], dim=-1)
            return u * cos + rotated * sin

        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, c.num_heads, hd).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, c.num_kv_heads, hd).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, c.num_kv_heads, hd).transpose(0, 1)
            q, k = rope(q), rope(k)  # [H, T, D], [KVH, T, D]
            k = k.repeat_interleave(c.num_queries_per_kv, dim=0)
            v = v.repeat_interleave(c.num_queries_per_kv, dim=0)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            x = x + o.transpose(0, 1).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return self._norm(x, "model.norm.weight") @ w["lm_head.weight"].T
