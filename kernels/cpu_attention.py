"""The compiled CPU paged-attention kernel (cpu_paged_attention.c), built once per machine.

The system C compiler builds it into a per-user cache the first time it is needed (~0.3 s), keyed
by the source, the flags and the machine, and ctypes loads it. Its instruction-set level
(ISA_LEVELS: AVX512-BF16, AVX2 + FMA, or plain C) is chosen from the CPU's features at run time,
never with -march=native, so it uses no instruction the CPU lacks (AMX included);
KernelOptions.isa forces a lower one. OpenMP in it binds to the libgomp torch has already
loaded, so it shares torch's threads.
No compiler, or BRIGADE_CPU_KERNEL=0: `load()` returns None and the engine uses torch's SDPA
(kernels/cpu_sdpa_attention.py) instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild
from kernels.cbuild import IsaLevels
from kernels.cbuild import cpu_flags as cpu_flags  # re-exported: the tests read this CPU's
from kernels.cbuild import is_x86 as _is_x86  # noqa: F401 - re-exported for the tests

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
# -ffast-math lets the compiler vectorize expf and reorder the fp32 sums; the kernel never
# produces infinities or NaNs from finite inputs. Each later set drops what a compiler lacked.
FLAG_SETS = (
    ("-O3", "-ffast-math", "-fopenmp"),
    ("-O3", "-ffast-math", "-fopenmp-simd"),
    ("-O3", "-ffast-math"),
)
# Instruction-set levels, best first: the compiler flags of each on x86-64 and the /proc/cpuinfo
# flags it needs. "none" is the x86-64 baseline (SSE2), or the compiler's default elsewhere.
ISA_LEVELS = ("avx512bf16", "avx2", "none")
_X86_ISA_FLAGS = {
    "avx512bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16")
    + ("-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "none": ("-march=x86-64",),
}
ISA_NEEDS = {
    "avx512bf16": frozenset(
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c")
    ),
    "avx2": frozenset(("avx2", "fma", "f16c")),
    "none": frozenset(),
}
_ISA_CODE = {"avx512bf16": 2, "avx2": 1, "none": 0}  # what the library's kernel_isa() returns
LEVELS = IsaLevels(compiler_flags=_X86_ISA_FLAGS, needs=ISA_NEEDS, codes=_ISA_CODE)

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i32, _i32, _i32, _i32, _i32]
_ARGTYPES += [_f32, _ptr, _i64, _i32]


class KernelOptions(cbuild.KernelOptions):
    """BRIGADE_CPU_KERNEL, CC and XDG_CACHE_HOME, and a forced level for tests."""

    LEVELS = ISA_LEVELS


def _bind(lib: ctypes.CDLL) -> None:
    for fn in (lib.paged_attention_bf16, lib.paged_attention_f32):
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int


_KERNEL = cbuild.CKernel(
    title="the CPU paged-attention kernel",
    source=SOURCE,
    levels=LEVELS,
    flag_sets=FLAG_SETS,
    bind=_bind,
    fallback="CPU attention uses the torch path",
    options=KernelOptions(),
)
configure = _KERNEL.configure
cache_dir = _KERNEL.cache_dir
compiler = _KERNEL.compiler
chosen_isa = _KERNEL.chosen_isa
load = _KERNEL.load
library_isa = LEVELS.of


def best_isa(flags: frozenset[str], x86: bool = True) -> str:
    """The best level whose features are all in `flags`; "none" off x86-64."""
    return LEVELS.best(flags, x86)


def available() -> bool:
    return load() is not None


def paged_attention_cpu(
    q: Tensor,  # [T, H, D] bf16 or fp32, heads and dims contiguous (rows may be strided)
    k_cache: Tensor,  # [num_blocks, block_size, KVH, D] q's dtype, contiguous
    v_cache: Tensor,
    block_tables: Tensor,  # [S, W] int32, contiguous
    seq_idx: Tensor,  # [n] int32: each query's row of block_tables
    rows: Tensor,  # [n] int32: each query's row of q (and of out)
    seq_lens: Tensor,  # [n] int32: keys each query attends, from position 0 (>= 1)
    scale: float,
    out: Tensor,  # [T, H, D] q's dtype, contiguous; only the rows listed in `rows` are written
    lib: ctypes.CDLL | None = None,  # default: load()
) -> None:
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available (see the log)")
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.dtype != q.dtype or t.device.type != "cpu":
            raise ValueError(
                f"{name} must be a {str(q.dtype).removeprefix('torch.')} CPU tensor (q's "
                f"dtype), got {t.dtype} on {t.device}"
            )
    if q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous():
        raise ValueError("q needs contiguous heads and dims, out must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()):
        raise ValueError("k_cache, v_cache and block_tables must be contiguous")
    index = (seq_idx, rows, seq_lens)
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in (block_tables, *index)):
        raise ValueError("block_tables, seq_idx, rows and seq_lens must be contiguous int32")
    fn = lib.paged_attention_bf16 if q.dtype == torch.bfloat16 else lib.paged_attention_f32
    status = fn(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_idx.data_ptr(),
        rows.data_ptr(),
        seq_lens.data_ptr(),
        seq_idx.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == -1:
        raise ValueError(
            f"{num_heads} heads over {num_kv_heads} KV heads with head_dim {head_dim}: the kernel "
            "takes at most 16 query heads per KV head and head_dim <= 256"
        )
    if status != 0:
        raise MemoryError("the CPU paged-attention kernel could not allocate its score buffer")
