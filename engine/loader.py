"""load_model: a GGUF file or a Hugging Face safetensors directory -> LlamaForCausalLM.

GGUF tensors are dequantized with the `gguf` package and renamed to Hugging Face's names;
attn_q / attn_k are un-permuted from llama.cpp's interleaved RoPE layout to rotate-half. For
fp32 on the CPU the Q4_1 / Q8_0 tensors' raw blocks are kept too (engine/gguf_linear.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from engine.config import ModelConfig
from engine.gguf_linear import GGUFBlocks
from engine.model import LlamaForCausalLM
from engine.quant import QUANTIZATIONS, Quantization
from engine.weights import model_format, read_gguf_header, resolve_model
from kernels import cpu_attention, cpu_quant_gemv

QuantizationArg = Quantization | Literal["auto"] | None
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def resolve_quantization(
    quantization: QuantizationArg,
    dtype: torch.dtype,
    device: torch.device,
    batch_invariant: bool = False,
) -> Quantization | None:
    """Resolve "auto": "int4-decode" for bf16 on the CPU, else no quantization.

    "int4-decode" runs int4 GEMVs for steps of at most 8 rows (decode of a few streams) and
    dense bf16 GEMMs for prefill and big batches: the fastest choice at every batch size here.
    fp32 and any dtype on CUDA stay unquantized, so fp32 reproduces the reference exactly.
    batch_invariant: "auto" is dense, and the "-decode" kinds are refused (they switch kernels
    with the step's row count).
    """
    if quantization == "auto":
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        return "int4-decode" if cpu_bf16 and not batch_invariant else None
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization={quantization!r}; allowed: 'auto', None, {', '.join(QUANTIZATIONS)}"
        )
    if batch_invariant and quantization is not None and quantization.endswith("-decode"):
        raise ValueError(
            f"quantization={quantization!r} switches kernels with the step's row count; allowed "
            "with batch_invariant=True: 'auto' (dense), None, 'int8', 'int4'"
        )
    return quantization


def check_batch_invariant(
    dtype: torch.dtype,
    device: torch.device,
    quant: Quantization | None = None,
    quantized_gemv: bool = True,
) -> None:
    """The batch-invariant mode needs attention in the compiled CPU kernel (one query token at a
    time, bf16 or fp32). In fp32 every linear runs the block GEMV (a GGUF file's Q4_1 / Q8_0
    blocks, rows in groups of 8): the dense fp32 GEMM, the block GEMM beside the GEMV and SDPA
    each sum differently with the row count. CUDA (cuBLAS) varies with it too."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"batch_invariant=True with dtype={str(dtype).removeprefix('torch.')!r} on "
            f"{device.type!r}; allowed: dtype 'float32' or 'bfloat16' on 'cpu'"
        )
    if dtype == torch.float32 and quant is not None:
        raise ValueError(
            f"batch_invariant=True in float32 with quantization={quant!r}; allowed: None or "
            "'auto' (the GGUF file's own blocks)"
        )
    if dtype == torch.float32 and not (quantized_gemv and cpu_quant_gemv.available()):
        raise RuntimeError(
            "batch_invariant=True in float32 runs every linear on the block GEMV, which is off "
            "(quantized_gemv=False, BRIGADE_QUANTIZED_GEMV=0) or could not be built here: it "
            "needs a C compiler (cc, gcc or $CC); or use dtype 'bfloat16'"
        )
    if not cpu_attention.available():
        raise RuntimeError(
            "batch_invariant=True needs the compiled CPU attention kernel, which is off or could "
            "not be built here: it needs a C compiler (cc, gcc or $CC) and BRIGADE_CPU_KERNEL "
            "unset or 1 (the log says what failed)"
        )


def load_model(
    model: str,
    *,
    dtype: torch.dtype | str,
    device: str | torch.device = "cpu",
    quantization: QuantizationArg = "auto",
    batch_invariant: bool = False,
    quantized_gemv: bool = True,
    fused_decode: bool = True,
    screened_head: bool = True,
    amx_prefill: bool = True,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load a registered name, a .gguf path or an HF directory onto `device` in `dtype`.

    quantization: None (dense weights in `dtype`); "int8" / "int4" (weight-only on every step,
    CPU); "int8-decode" / "int4-decode" (weight-only for steps of at most 8 rows, dense above);
    "auto" (see resolve_quantization). batch_invariant: a token's logits are bit-identical
    whatever shares its step and however its prompt was chunked (on the CPU: bf16, or fp32 on a
    GGUF file's own blocks; see check_batch_invariant).
    quantized_gemv: an fp32 GGUF model on the CPU with dense weights keeps its Q4_1 / Q8_0
    blocks and runs steps of at most 32 rows on the block GEMV, more rows on the block GEMM (the
    same weights, fewer bytes); without a C compiler, or for safetensors, the dense fp32 path.
    fused_decode: with those blocks, steps of at most 32 tokens run every layer in one C call
    (kernels/cpu_decode.py); off in the batch-invariant mode.
    screened_head: with a Q8_0 head among those blocks, greedy rows take their tokens through an
    int8 screen and the fp32 logits of what it leaves (kernels/cpu_greedy_head.py).
    amx_prefill: with Q4_1 blocks, steps of more than 32 rows run their layers' GEMMs on AMX's
    bf16 tiles with every factor split exactly into bf16 pieces (fp32 sums), where AMX works
    here (kernels/cpu_amx_gemm.py); elsewhere, or off, the block GEMM.
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    device = torch.device(device)
    quant = resolve_quantization(quantization, dtype, device, batch_invariant)
    if batch_invariant:
        check_batch_invariant(dtype, device, quant, quantized_gemv)
    path = resolve_model(model)
    blocks = None
    if model_format(path) == "hf":
        config, weights = read_hf_dir(path)
    else:
        config, weights = read_gguf(path)
        fp32_dense_cpu = dtype == torch.float32 and quant is None and device.type == "cpu"
        if quantized_gemv and fp32_dense_cpu and cpu_quant_gemv.available():
            blocks = read_gguf_blocks(path, config)
    weights = {k: w.to(device) for k, w in weights.items()}
    llama = LlamaForCausalLM(
        config,
        weights,
        dtype=dtype,
        device=device,
        quantization=quant,
        batch_invariant=batch_invariant,
        blocks=blocks,
        fused_decode=fused_decode,
        screened_head=screened_head,
        amx_prefill=amx_prefill,
    )
    return llama, config


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Config and float32 weights (HF names, HF RoPE layout) of a Llama GGUF file."""
    import gguf

    header = read_gguf_header(path)
    config = ModelConfig.from_gguf_metadata(
        header.metadata, has_output_weight="output.weight" in header.tensors
    )
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict[str, Tensor] = {}
    for info in header.tensors.values():
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        num_bytes = int(np.prod(info.shape)) // block * type_size
        data = raw[info.offset : info.offset + num_bytes]
        rows = data.reshape(*info.shape[:-1], -1)  # [..., bytes per row]
        if qtype == gguf.GGMLQuantizationType.F32:
            array = rows.view(np.float32).reshape(info.shape).copy()
        else:
            array = gguf.quants.dequantize(rows, qtype).reshape(info.shape)
        weights[_gguf_to_hf_name(info.name)] = torch.from_numpy(np.ascontiguousarray(array))
    for i in range(config.num_layers):
        attn = f"model.layers.{i}.self_attn."
        weights[attn + "q_proj.weight"] = _unpermute(
            weights[attn + "q_proj.weight"], config.num_heads
        )
        weights[attn + "k_proj.weight"] = _unpermute(
            weights[attn + "k_proj.weight"], config.num_kv_heads
        )
    return config, weights


_BLOCK_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGML type name -> cpu_quant_gemv kind


def read_gguf_blocks(path: Path, config: ModelConfig) -> dict[str, GGUFBlocks]:
    """The blocks of a GGUF file's Q4_1 / Q8_0 matrices as the kernels hold them
    (cpu_quant_gemv.from_gguf; HF names, HF RoPE layout): each [out, in / 32 * block_bytes] uint8,
    attn_q / attn_k rows un-permuted as read_gguf does."""
    import gguf

    header = read_gguf_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    blocks: dict[str, GGUFBlocks] = {}
    for info in header.tensors.values():
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        if qtype.name not in _BLOCK_KINDS or len(info.shape) != 2:
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        out_features, in_features = info.shape
        num_bytes = out_features * in_features // block * type_size
        rows = np.array(raw[info.offset : info.offset + num_bytes]).reshape(out_features, -1)
        kind = _BLOCK_KINDS[qtype.name]
        blocks[_gguf_to_hf_name(info.name)] = GGUFBlocks(
            kind, cpu_quant_gemv.from_gguf(torch.from_numpy(rows), kind)
        )
    for i in range(config.num_layers):
        attn = f"model.layers.{i}.self_attn."
        for name, num_heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            found = blocks.get(f"{attn}{name}.weight")
            if found is not None:  # whole rows of blocks move, as rows of weights do
                blocks[f"{attn}{name}.weight"] = GGUFBlocks(
                    found.kind, _unpermute(found.data, num_heads)
                )
    return blocks


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _GGUF_LAYER:
        raise ValueError(f"GGUF tensor {name!r} is not part of a plain Llama model")
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.weight"


def _unpermute(w: Tensor, num_heads: int) -> Tensor:
    """llama.cpp interleaves each head's rotary pairs; restore HF's [first half | second half]."""
    out_features, in_features = w.shape
    head_dim = out_features // num_heads
    # [H, D/2, 2, in] -> [H, 2, D/2, in]
    w = w.reshape(num_heads, head_dim // 2, 2, in_features).transpose(1, 2)
    return w.reshape(out_features, in_features).contiguous()


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Config and weights of a Hugging Face Llama directory (config.json + *.safetensors)."""
    from safetensors.torch import load_file

    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    weights: dict[str, Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    expected = _hf_weight_names(config)
    missing = sorted(expected - weights.keys())
    if missing:
        raise ValueError(f"{str(path)!r} lacks {len(missing)} weights, e.g. {missing[:3]}")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights and weights[name].shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"{name} has shape {tuple(weights[name].shape)}, config.json says "
                f"[{config.vocab_size}, {config.hidden_size}]"
            )
    return config, {k: w.float() for k, w in weights.items() if k in expected}


def _hf_weight_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        names |= {f"model.layers.{i}.{v}.weight" for v in _GGUF_LAYER.values()}
    return names
