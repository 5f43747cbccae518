"""fp32 GEMMs over GGUF Q4_1 / Q8_0 blocks (cpu_quant_gemm.c) for steps of many rows.

`quant_gemm(x, blocks, kind)` is x [rows, in] fp32 times the weight the blocks hold, transposed,
for any number of rows: panels of output features are dequantized once to exactly the fp32
weights `gguf` gives (cpu_quant_gemv.dequantize) and reused by every row, sums stay fp32, so the
result is the fp32 matmul's up to summation order, and each row's result is the same whatever
rows share the call and whatever the thread count. The build, the levels (avx512 / avx2 / none,
chosen from the CPU's features at run time, GemmOptions.isa forces one) and the block layout are
cpu_quant_gemv's. No compiler, or `enabled=False`: `load()` returns None.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild
from kernels.cpu_quant_gemv import (
    FLAG_SETS,
    ISA_LEVELS,
    LEVELS,
    BlockKind,
    check_blocks,
    dequantize,
)

SOURCE = Path(__file__).with_name("cpu_quant_gemm.c")

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32]


class GemmOptions(cbuild.KernelOptions):
    """The compiler and cache (the switch is EngineConfig.quantized_gemv), a forced level."""

    LEVELS = ISA_LEVELS


def _bind(lib: ctypes.CDLL) -> None:
    for fn in (lib.gemm_q4_1, lib.gemm_q8_0):
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int


_KERNEL = cbuild.CKernel(
    title="the CPU quantized GEMM kernel",
    source=SOURCE,
    levels=LEVELS,
    flag_sets=FLAG_SETS,
    bind=_bind,
    fallback="fp32 GGUF linears use dense weights for steps of more than 32 rows",
    options=GemmOptions(),
)
configure = _KERNEL.configure
cache_dir = _KERNEL.cache_dir
chosen_isa = _KERNEL.chosen_isa
load = _KERNEL.load
library_isa = LEVELS.of


def available() -> bool:
    return load() is not None


def quant_gemm(
    x: Tensor,  # [rows, in] fp32, rows >= 1; each row contiguous (rows may be strided)
    blocks: Tensor,  # [out, in / 32 * block_bytes] uint8, contiguous
    kind: BlockKind,
    out: Tensor | None = None,  # [rows, out] fp32, rows contiguous; default: a new tensor
    lib: ctypes.CDLL | None = None,  # default: load()
) -> Tensor:
    """x @ W.T for the weight W [out, in] that `blocks` hold, in fp32 -> [rows, out]."""
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the CPU quantized GEMM kernel is not available (see the log)")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(
            f"x must be a 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    rows, in_features = x.shape
    if rows < 1:
        raise ValueError("x has no rows")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    check_blocks(blocks, kind, in_features)
    out_features = blocks.shape[0]
    if out is None:
        out = torch.empty(rows, out_features, dtype=torch.float32)
    elif (
        out.dtype != torch.float32
        or tuple(out.shape) != (rows, out_features)
        or (out.stride(1) != 1 or out.device.type != "cpu")
    ):
        raise ValueError(
            f"out must be a [{rows}, {out_features}] float32 CPU tensor, rows contiguous"
        )
    fn = lib.gemm_q4_1 if kind == "q4_1" else lib.gemm_q8_0
    status = fn(
        blocks.data_ptr(),
        out_features,
        in_features,
        x.data_ptr(),
        x.stride(0),
        rows,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError(f"gemm_{kind}: no memory to pack {rows} x {in_features} fp32 inputs")
    assert status == 0, f"gemm_{kind} refused a shape the wrapper checked: {tuple(x.shape)}"
    return out


def quant_gemm_reference(x: Tensor, blocks: Tensor, kind: BlockKind) -> Tensor:
    """The slow definition: dequantize to fp32, then an fp32 matmul."""
    check_blocks(blocks, kind, x.shape[1])
    return x.float() @ dequantize(blocks, kind).t()
