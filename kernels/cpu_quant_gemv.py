"""fp32 GEMVs over GGUF Q4_1 / Q8_0 blocks (cpu_quant_gemv.c), built once per machine.

The kernels take blocks as Brigade holds them (`from_gguf` makes them from a GGUF file's bytes):
Q8_0 in GGUF's own 34-byte layout, Q4_1 in 24 bytes, its fp16 scale and minimum widened to fp32
(exactly) ahead of GGUF's 16 bytes of nibbles, so the kernels load them instead of converting
them for every block (cpu_quant_blocks.h).

`quant_gemv(x, blocks, kind)` is x [rows, in] fp32 times the weight the blocks hold,
transposed, rows in groups of MAX_ROWS (a decode step's few rows, or every row of a step in the
batch-invariant mode): each weight is rebuilt in registers to exactly the value `gguf` dequantizes it to,
activations and sums stay fp32, so the result is the fp32 matmul's up to summation order while
reading 0.75 (Q4_1) / 1.0625 (Q8_0) bytes a weight instead of 4. The build (cache, compiler,
flags) is kernels/cbuild.py's; the instruction-set level (ISA_LEVELS) is chosen from the CPU's
features at run time, GemvOptions.isa forces a lower one. `quant_gemv_reference` is the slow
pure-torch definition. No compiler, or `enabled=False`: `load()` returns None.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from kernels import cbuild
from kernels.cbuild import IsaLevels
from kernels.cbuild import cpu_flags as cpu_flags  # re-exported: the tests read this CPU's
from kernels.cbuild import is_x86 as is_x86  # re-exported for the tests

SOURCE = Path(__file__).with_name("cpu_quant_gemv.c")
BlockKind = Literal["q4_1", "q8_0"]
BLOCK_SIZE = 32  # weights per block
GGUF_BLOCK_BYTES: dict[str, int] = {"q4_1": 20, "q8_0": 34}  # fp16 d (+ fp16 m), then the codes
BLOCK_BYTES: dict[str, int] = {"q4_1": 24, "q8_0": 34}  # as held: Q4_1's d and m in fp32
Q4_1_CODES = 8  # the nibbles' offset in a held Q4_1 block
MAX_ROWS = 8  # rows a group: each tile of weights is read once per group
MAX_STEP_ROWS = 32  # rows a call takes through a tile at once (ROWS_MAX, cpu_quant_dot.h)
# -ffast-math lets the plain-C level vectorize its sums (reordering them); the weights are
# rebuilt with one exact rounding whatever the flags. Each later set drops what a compiler lacked.
FLAG_SETS = (
    ("-O3", "-ffast-math", "-fopenmp"),
    ("-O3", "-ffast-math", "-fopenmp-simd"),
    ("-O3", "-ffast-math"),
)
ISA_LEVELS = ("avx512", "avx2", "none")
_X86_ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "none": ("-march=x86-64",),
}
ISA_NEEDS = {
    "avx512": frozenset(("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c")),
    "avx2": frozenset(("avx2", "fma", "f16c")),
    "none": frozenset(),
}
_ISA_CODE = {"avx512": 2, "avx2": 1, "none": 0}  # what the library's kernel_isa() returns
LEVELS = IsaLevels(compiler_flags=_X86_ISA_FLAGS, needs=ISA_NEEDS, codes=_ISA_CODE)

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _i32, _ptr, _i64, _i32]


class GemvOptions(cbuild.KernelOptions):
    """The compiler and cache (the switch is EngineConfig.quantized_gemv), a forced level."""

    LEVELS = ISA_LEVELS


def _bind(lib: ctypes.CDLL) -> None:
    for fn in (lib.gemv_q4_1, lib.gemv_q8_0):
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int


_KERNEL = cbuild.CKernel(
    title="the CPU quantized GEMV kernel",
    source=SOURCE,
    levels=LEVELS,
    flag_sets=FLAG_SETS,
    bind=_bind,
    fallback="fp32 GGUF linears use dense weights",
    options=GemvOptions(),
)
configure = _KERNEL.configure
cache_dir = _KERNEL.cache_dir
chosen_isa = _KERNEL.chosen_isa
load = _KERNEL.load
library_isa = LEVELS.of


def best_isa(flags: frozenset[str], x86: bool = True) -> str:
    """The best level whose features are all in `flags`; "none" off x86-64."""
    return LEVELS.best(flags, x86)


def available() -> bool:
    return load() is not None


def check_blocks(blocks: Tensor, kind: str, in_features: int) -> None:
    """`blocks` must be [out, in / 32 * block_bytes] contiguous uint8 on the CPU."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"block kind {kind!r}; allowed: {', '.join(BLOCK_BYTES)}")
    if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or blocks.dim() != 2:
        raise ValueError(
            f"blocks must be a 2-D uint8 CPU tensor, got {blocks.dtype} {tuple(blocks.shape)} "
            f"on {blocks.device}"
        )
    if in_features % BLOCK_SIZE:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK_SIZE}")
    row_bytes = in_features // BLOCK_SIZE * BLOCK_BYTES[kind]
    if blocks.shape[1] != row_bytes:
        raise ValueError(
            f"{kind} blocks of {in_features} inputs take {row_bytes} bytes a row, "
            f"got {blocks.shape[1]}"
        )
    if not blocks.is_contiguous():
        raise ValueError("blocks must be contiguous")


def quant_gemv(
    x: Tensor,  # [rows, in] fp32, rows >= 1; each row contiguous (rows may be strided)
    blocks: Tensor,  # [out, in / 32 * block_bytes] uint8, contiguous
    kind: BlockKind,
    out: Tensor | None = None,  # [rows, out] fp32, rows contiguous; default: a new tensor
    lib: ctypes.CDLL | None = None,  # default: load()
) -> Tensor:
    """x @ W.T for the weight W [out, in] that `blocks` hold, in fp32 -> [rows, out]."""
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the CPU quantized GEMV kernel is not available (see the log)")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(
            f"x must be a 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    rows, in_features = x.shape
    if rows < 1:
        raise ValueError(f"{rows} rows; the kernel takes at least 1")
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
    fn = lib.gemv_q4_1 if kind == "q4_1" else lib.gemv_q8_0
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
    assert status == 0, f"gemv_{kind} refused a shape the wrapper checked: {tuple(x.shape)}"
    return out


def from_gguf(rows: Tensor, kind: BlockKind) -> Tensor:
    """A GGUF tensor's blocks [out, in / 32 * gguf_block_bytes] uint8 -> the blocks as held
    [out, in / 32 * block_bytes]: Q8_0 as they are, Q4_1 with its fp16 d and m widened to fp32
    (exact), then its 16 bytes of nibbles."""
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"block kind {kind!r}; allowed: {', '.join(GGUF_BLOCK_BYTES)}")
    size = GGUF_BLOCK_BYTES[kind]
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % size:
        raise ValueError(
            f"GGUF {kind} rows must be 2-D uint8 of whole {size}-byte blocks, got {rows.dtype} "
            f"{tuple(rows.shape)}"
        )
    if kind == "q8_0":
        return rows.contiguous()
    out_features = rows.shape[0]
    b = rows.reshape(out_features, -1, size)  # [out, in / 32, 20]
    scales = b[..., 0:4].contiguous().view(torch.float16).float()  # [out, in / 32, 2]: d, m
    held = torch.empty(out_features, b.shape[1], BLOCK_BYTES[kind], dtype=torch.uint8)
    held[..., :Q4_1_CODES] = scales.view(torch.uint8)
    held[..., Q4_1_CODES:] = b[..., 4:]
    return held.reshape(out_features, -1)


def dequantize(blocks: Tensor, kind: BlockKind) -> Tensor:
    """The fp32 weight [out, in] that held blocks [out, bytes] hold, as the `gguf` package
    computes it from the file: Q4_1 d * q + m (q[i] the low nibble of byte i, q[i + 16] its high
    nibble), Q8_0 d * q."""
    out_features = blocks.shape[0]
    b = blocks.reshape(out_features, -1, BLOCK_BYTES[kind])  # [out, in / 32, block_bytes]
    if kind == "q8_0":
        d = b[..., 0:2].contiguous().view(torch.float16).float()  # [out, in / 32, 1]
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [out, in / 32, 32]
        return (q * d).reshape(out_features, -1)
    d = b[..., 0:4].contiguous().view(torch.float32)
    m = b[..., 4:8].contiguous().view(torch.float32)
    qs = b[..., Q4_1_CODES:]  # [out, in / 32, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [out, in / 32, 32]
    return (d * q + m).reshape(out_features, -1)


def quant_gemv_reference(x: Tensor, blocks: Tensor, kind: BlockKind) -> Tensor:
    """The slow definition: dequantize to fp32, then an fp32 matmul."""
    check_blocks(blocks, kind, x.shape[1])
    return x.float() @ dequantize(blocks, kind).t()
