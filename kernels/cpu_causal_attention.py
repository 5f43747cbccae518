"""fp32 causal self-attention of a prefill chunk with nothing cached before it
(cpu_causal_attention.c): a KV head's query rows for 16 positions share each key and value row
they load. fp32 sums in another order than torch's SDPA; the engine takes it for its prefill
chunks on GGUF blocks (the default), while the dense fp32 path keeps SDPA, transformers' kernel.
Levels: avx512 / none, chosen from the CPU at run time. No compiler: `load()` returns None.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild
from kernels.cbuild import IsaLevels
from kernels.cpu_quant_gemv import FLAG_SETS, ISA_NEEDS

SOURCE = Path(__file__).with_name("cpu_causal_attention.c")
LEVELS = IsaLevels(
    compiler_flags={
        "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"),
        "none": ("-march=x86-64",),
    },
    needs={"avx512": ISA_NEEDS["avx512"], "none": frozenset()},
    codes={"avx512": 2, "none": 0},
)
_i32, _i64, _ptr, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class CausalOptions(cbuild.KernelOptions):
    LEVELS = tuple(LEVELS.names)


def _bind(lib: ctypes.CDLL) -> None:
    lib.causal_attention.argtypes = [
        _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i32, _i32, _i32, _i32, _f32, _i32
    ]  # fmt: skip
    lib.causal_attention.restype = ctypes.c_int


_KERNEL = cbuild.CKernel(
    title="the CPU causal prefill attention kernel",
    source=SOURCE,
    levels=LEVELS,
    flag_sets=FLAG_SETS,
    bind=_bind,
    fallback="prefill chunks attend through torch's SDPA",
    options=CausalOptions(),
)
configure = _KERNEL.configure
load = _KERNEL.load
library_isa = LEVELS.of


def available() -> bool:
    return load() is not None


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor | None = None
) -> Tensor:
    """q [T, H, D], k and v [T, KVH, D] fp32 (rows strided, heads and dims contiguous) ->
    o [T, H, D]: token i over tokens 0..i, query head h on KV head h // (H / KVH); written into
    `out` (contiguous [T, H, D] fp32) when given, else a new tensor."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU causal attention kernel is not available (see the log)")
    t, h, d = q.shape
    kvh = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3:
            raise ValueError(f"{name} must be a 3-D float32 CPU tensor, got {x.dtype} {x.shape}")
        if x.shape[0] != t or x.shape[2] != d or x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"{name} {tuple(x.shape)}: heads and dims must be contiguous")
    if k.shape != v.shape or h % kvh or h // kvh > 8:
        raise ValueError(f"{h} query heads over {kvh} KV heads (at most 8 a KV head)")
    if out is None:
        out = torch.empty(t, h, d, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (t, h, d) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{t}, {h}, {d}] float32 tensor")
    o = out
    status = lib.causal_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        o.data_ptr(), t, h, kvh, d, scale, torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise MemoryError(f"causal_attention: no memory for {t} tokens")
    assert status == 0, f"causal_attention refused a shape the wrapper checked: {tuple(q.shape)}"
    return o
