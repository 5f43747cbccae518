"""The greedy rows' tokens through a Q8_0 LM head, screened in int8 (cpu_greedy_head.c).

`ScreenedHead(blocks).argmax(h)` is `argmax_rows(quant_gemv(h, blocks, "q8_0"))`, the same
tokens, for the final norm's output h [rows, hidden]: the kernel sums each logit with int8
inputs (`vpdpbusd`, 64 products an instruction where the fp32 GEMV's FMAs take 16), bounds its
error, and lists the tokens that may hold each row's argmax; their fp32 logits, from the same
GEMV over just their rows of blocks (bit for bit the full head's: the GEMV sums each output
feature on its own), decide, the first of ties winning as in torch.argmax. The head's bytes are
held a second time, repacked (~1 byte a weight). Where the kernel cannot decide (a value in h
that is not finite, more than MAX_CANDIDATES tokens in a row), `argmax` returns None and the
caller computes the whole head. Built at AVX-512 VNNI or in plain C, from the CPU's features at
run time; only the VNNI build is faster than the fp32 GEMV (`fast()`). Where AMX's int8 tiles
run (cpu_amx_gemm.available()), the sums and bounds come from them instead (cpu_amx_gemm.c
amx_screen: each row of x cut into two int8 pieces, the head rounded per vocabulary row, whole
rows of K a tile product), and this library lists the candidates from them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild, cpu_amx_gemm, cpu_quant_gemv
from kernels.cbuild import IsaLevels
from kernels.cpu_argmax import argmax_rows

SOURCE = Path(__file__).with_name("cpu_greedy_head.c")
ISA_LEVELS = ("avx512vnni", "none")
# the GEMV's AVX-512 level (cpu_quant_blocks.h's ISA_LEVEL 2) and VNNI, or plain C
LEVELS = IsaLevels(
    compiler_flags={
        "avx512vnni": (*cpu_quant_gemv.LEVELS.compiler_flags["avx512"], "-mavx512vnni"),
        "none": cpu_quant_gemv.LEVELS.compiler_flags["none"],
    },
    needs={
        "avx512vnni": cpu_quant_gemv.ISA_NEEDS["avx512"] | {"avx512_vnni"},
        "none": frozenset(),
    },
    codes={"avx512vnni": 2, "none": 0},
)
LANES, BLOCK = 16, cpu_quant_gemv.BLOCK_SIZE
BLOCK_BYTES = cpu_quant_gemv.BLOCK_BYTES["q8_0"]
MAX_ROWS = 32  # rows a call screens (the engine's decode steps: cpu_decode.MAX_ROWS)
MAX_CANDIDATES = 1024  # a row's tokens left to recompute; more and the whole head runs
# From this many rows the screen is worth its cost: one row's head waits on its 28 MB of weights
# either way, and at 4 rows repeated runs gave 0.81-1.36x (docs/benchmarks.md).
MIN_ROWS = 8

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


class HeadOptions(cbuild.KernelOptions):
    """The switch (EngineConfig.screened_head), the compiler and cache, a forced level."""

    LEVELS = ISA_LEVELS


def _bind(lib: ctypes.CDLL) -> None:
    lib.screen_pack_q8_0.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr]
    lib.screen_pack_q8_0.restype = ctypes.c_int
    lib.screen_rows.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
    lib.screen_rows.argtypes += [_i32, _i32]
    lib.screen_rows.restype = ctypes.c_int
    lib.list_candidates.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i32, _i32]
    lib.list_candidates.restype = ctypes.c_int


_KERNEL = cbuild.CKernel(
    title="the screened greedy LM head",
    source=SOURCE,
    levels=LEVELS,
    flag_sets=cpu_quant_gemv.FLAG_SETS,
    bind=_bind,
    fallback="greedy rows take the argmax of the whole fp32 head",
    options=HeadOptions(),
)
configure = _KERNEL.configure
load = _KERNEL.load
library_isa = LEVELS.of


def fast() -> bool:
    """A VNNI build: the screen beats the fp32 GEMV it replaces."""
    lib = load()
    return lib is not None and library_isa(lib) == "avx512vnni"


class ScreenedHead:
    """A Q8_0 head [vocab, hidden] repacked for the screen, with scratch for MAX_ROWS rows.
    `amx`: the int8 tiles' screen (None: where they run), else this library's."""

    def __init__(
        self, blocks: Tensor, lib: ctypes.CDLL | None = None, amx: bool | None = None
    ) -> None:
        lib = lib or load()
        if lib is None:
            raise RuntimeError("the screened greedy head is not available (see the log)")
        cpu_quant_gemv.check_blocks(blocks, "q8_0", blocks.shape[1] // BLOCK_BYTES * BLOCK)
        self.lib, self.blocks = lib, blocks
        self.vocab, nb = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES
        self.hidden = nb * BLOCK
        if amx is None:
            amx = cpu_amx_gemm.available()
        if amx and not cpu_amx_gemm.available():
            raise RuntimeError("the AMX screen does not run here (cpu_amx_gemm.available())")
        self.amx: cpu_amx_gemm.ScreenPacked | None = None
        if amx:
            self.amx = cpu_amx_gemm.pack_screen(blocks)
            width = self.amx.padded_vocab
            self.lo_max = torch.empty(MAX_ROWS, dtype=torch.float32)
        else:
            groups = (self.vocab + LANES - 1) // LANES
            self.wpack = torch.empty(groups * nb * BLOCK * LANES, dtype=torch.uint8)
            self.dpack = torch.empty(groups * nb * LANES, dtype=torch.float32)
            self.apack = torch.empty(groups * nb * LANES, dtype=torch.float32)
            if lib.screen_pack_q8_0(blocks.data_ptr(), self.vocab, nb, self.wpack.data_ptr(),
                                    self.dpack.data_ptr(), self.apack.data_ptr()):  # fmt: skip
                raise ValueError("a Q8_0 block's scale is not finite")
            width = groups * LANES
        self.hi = torch.empty(MAX_ROWS, width, dtype=torch.float32)
        self.cand = torch.empty(MAX_ROWS, MAX_CANDIDATES, dtype=torch.int32)
        self.ncand = torch.empty(MAX_ROWS, dtype=torch.int32)

    def _bounds_and_list(self, h: Tensor) -> int:
        """The kernels' status: candidates into cand / ncand, or why not."""
        rows, threads = h.shape[0], torch.get_num_threads()
        if self.amx is None:
            return self.lib.screen_rows(
                h.data_ptr(), rows, self.vocab, self.hidden // BLOCK, self.wpack.data_ptr(),
                self.dpack.data_ptr(), self.apack.data_ptr(), self.hi.data_ptr(),
                self.cand.data_ptr(), self.ncand.data_ptr(), MAX_CANDIDATES, threads,
            )  # fmt: skip
        if not cpu_amx_gemm.amx_screen(self.amx, h, self.hi, self.lo_max):
            return -1
        return self.lib.list_candidates(
            self.hi.data_ptr(), rows, self.vocab, self.hi.shape[1], self.lo_max.data_ptr(),
            self.cand.data_ptr(), self.ncand.data_ptr(), MAX_CANDIDATES, threads,
        )  # fmt: skip

    def _screen(self, h: Tensor) -> tuple[Tensor, Tensor] | None:
        """Every row's candidates, ascending, flat [n] int64, and the row of each [n]; None
        where the screen cannot tell (a value of h not finite, too many tokens in a row)."""
        rows = h.shape[0]
        if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(
                f"h must be [rows, {self.hidden}] float32, got {h.dtype} {tuple(h.shape)}"
            )
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"{rows} rows; the screen takes 1 to {MAX_ROWS}")
        if self._bounds_and_list(h) != 0:
            return None
        counts = self.ncand[:rows].to(torch.int64)
        if int(counts.min()) == 0:  # only where sums overflowed: the bounds say nothing
            return None
        listed = torch.arange(MAX_CANDIDATES) < counts[:, None]  # [rows, MAX_CANDIDATES]
        flat = self.cand[:rows][listed].to(torch.int64)  # row-major: each row's, ascending
        return flat, torch.repeat_interleave(torch.arange(rows), counts)

    def candidates(self, h: Tensor) -> list[Tensor] | None:
        """Each row's tokens that may hold its argmax, ascending (None: see _screen)."""
        found = self._screen(h.contiguous())
        if found is None:
            return None
        flat, row = found
        return list(flat.split(torch.bincount(row, minlength=h.shape[0]).tolist()))

    def argmax(self, h: Tensor) -> Tensor | None:
        """[rows] int64: argmax_rows of h's fp32 logits through the head; None: compute them."""
        h = h.contiguous()
        found = self._screen(h)
        if found is None:
            return None
        flat, row = found
        union = torch.unique(flat)  # sorted: the first of ties is the lowest token
        exact = cpu_quant_gemv.quant_gemv(h, self.blocks.index_select(0, union), "q8_0")
        listed = torch.zeros_like(exact, dtype=torch.bool)
        listed[row, torch.searchsorted(union, flat)] = True
        return union[argmax_rows(exact.masked_fill_(~listed, float("-inf")))]
