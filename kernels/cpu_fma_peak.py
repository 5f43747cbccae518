"""The CPU's fp32 FMA peak (cpu_fma_peak.c), built once per machine at the GEMV's instruction-set
levels: what no fp32 kernel can beat, the ceiling `brigade bench peer` sets under prefill.
No compiler: `fma_peak()` returns None.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

from kernels import cbuild, cpu_quant_gemv

SOURCE = Path(__file__).with_name("cpu_fma_peak.c")


def _bind(lib: ctypes.CDLL) -> None:
    lib.fma_flops.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    lib.fma_flops.restype = ctypes.c_double


_KERNEL = cbuild.CKernel(
    title="the FMA peak probe",
    source=SOURCE,
    levels=cpu_quant_gemv.LEVELS,
    flag_sets=cpu_quant_gemv.FLAG_SETS,
    bind=_bind,
    fallback="the prefill ceiling is not measured",
    options=cpu_quant_gemv.GemvOptions(),
)
load = _KERNEL.load


def fma_peak(threads: int, seconds: float = 0.2, repetitions: int = 5) -> float | None:
    """fp32 flops a second the FMA units issue on `threads` threads, at the widest vectors the
    CPU has: the best of `repetitions` runs of about `seconds` each; None without a compiler."""
    lib = load()
    if lib is None:
        return None
    sink = (ctypes.c_float * 1)()
    return best_rate(
        lambda iters: lib.fma_flops(iters, threads, sink), 1 << 16, seconds, repetitions
    )


def best_rate(work: Callable[[int], float], iters: int, seconds: float, repetitions: int) -> float:
    """The most work a second `work(iters)` (which returns the work it did) reaches: its run grown
    from `iters` until it takes a quarter of `seconds`, scaled to about `seconds`, then the best
    of `repetitions` runs."""
    while True:
        t0 = time.perf_counter()
        work(iters)
        took = time.perf_counter() - t0
        if took >= seconds / 4:
            break
        iters *= 4
    iters = int(iters * seconds / took)
    best = 0.0
    for _ in range(repetitions):
        t0 = time.perf_counter()
        done = work(iters)
        best = max(best, done / (time.perf_counter() - t0))
    return best
