"""The greedy token of each row (cpu_argmax.c): torch.argmax over fp32 CPU logits [rows, vocab],
the same indices, at vector width. Built once per machine at the GEMV's instruction-set levels;
without a compiler, or for any other tensor, `argmax_rows` is torch.argmax itself.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild, cpu_quant_gemv

SOURCE = Path(__file__).with_name("cpu_argmax.c")


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int32]
    lib.argmax_rows.restype = None


_KERNEL = cbuild.CKernel(
    title="the CPU argmax",
    source=SOURCE,
    levels=cpu_quant_gemv.LEVELS,
    flag_sets=cpu_quant_gemv.FLAG_SETS,
    bind=_bind,
    fallback="greedy rows use torch.argmax",
    options=cpu_quant_gemv.GemvOptions(),
)
load = _KERNEL.load
configure = _KERNEL.configure


def argmax_rows(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1) for a 2-D tensor -> [rows] int64: the first index of each row's
    greatest value, a NaN above every number. fp32 CPU rows with contiguous columns take the
    kernel; anything else (or no kernel) torch.argmax."""
    lib = load() if logits.device.type == "cpu" else None
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.shape[0] == 0
        or logits.shape[1] == 0
        or logits.stride(1) != 1
    ):
        return logits.argmax(dim=-1)
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_rows(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr(),
                    torch.get_num_threads())  # fmt: skip
    return out
