"""fp32 GEMMs over GGUF Q4_1 blocks on AMX's bf16 tiles (cpu_amx_gemm.c), for prefill chunks.

`amx_gemm(x, packed)` is x [rows, in] fp32 times the weight `pack(blocks)` holds, transposed:
d * q and m split exactly into two bf16 pieces, x into two rounded to nearest (16 significant
bits), three tile products summed in fp32, so each term is within 2^-14 of |x w| and the errors
are unbiased (cpu_amx_gemm.c); cpu_quant_gemm's FMA kernels are the exact fp32 path. Used only where it works: the CPU lists AMX (tile, bf16) and AVX-512 BF16,
the kernel builds with them, Linux grants the tile state (arch_prctl) and one tile product on
this CPU gives the right sums, first in a forked child (a trap kills the child, not the engine);
`available()` says whether all of that held. A VM may list AMX
and not enable it; then this kernel is never called and cpu_quant_gemm runs instead.

The same tiles in int8 screen the greedy rows' LM head (`amx_screen`, for
cpu_greedy_head.ScreenedHead): whole rows of K a tile product, on a copy of the head rounded
per vocabulary row (`pack_screen`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild
from kernels.cbuild import IsaLevels
from kernels.cpu_fma_peak import best_rate
from kernels.cpu_quant_gemv import BLOCK_BYTES, Q4_1_CODES, check_blocks

SOURCE = Path(__file__).with_name("cpu_amx_gemm.c")
PANEL = 16  # output features a tile's columns hold; panels go in pairs
PIECE_PRODUCTS = 3  # bf16 tile products an fp32 multiply-add costs (cpu_amx_gemm.c)
FLAG_SETS = (("-O2", "-fopenmp"), ("-O2",))
LEVELS = IsaLevels(
    compiler_flags={
        "amx": (
            "-mamx-tile",
            "-mamx-bf16",
            "-mamx-int8",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512bf16",
        ),
        "none": (),
    },  # fmt: skip
    needs={
        "amx": frozenset(
            (
                "amx_tile",
                "amx_bf16",
                "amx_int8",
                "avx512f",
                "avx512bw",
                "avx512vl",
                "avx512dq",
                "avx512_bf16",
            )
        ),
        "none": frozenset(),
    },
    codes={"amx": 3, "none": 0},
)

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


class AmxGemmOptions(cbuild.KernelOptions):
    """The compiler and cache; `enabled=False` keeps every prefill on cpu_quant_gemm."""

    LEVELS = tuple(LEVELS.names)


def _bind(lib: ctypes.CDLL) -> None:
    lib.amx_ready.argtypes, lib.amx_ready.restype = [], ctypes.c_int
    lib.amx_tile_flops.argtypes = [ctypes.c_int64, ctypes.c_int32]
    lib.amx_tile_flops.restype = ctypes.c_double
    fn = lib.amx_gemm_q4_1
    fn.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32]
    fn.restype = ctypes.c_int
    lib.amx_screen.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i32]
    lib.amx_screen.restype = ctypes.c_int


_KERNEL = cbuild.CKernel(
    title="the CPU AMX GEMM kernel",
    source=SOURCE,
    levels=LEVELS,
    flag_sets=FLAG_SETS,
    bind=_bind,
    fallback="prefill runs on the AVX-512 / AVX2 block GEMM",
    options=AmxGemmOptions(),
)
cache_dir = _KERNEL.cache_dir
load = _KERNEL.load
library_isa = LEVELS.of


def configure(options: AmxGemmOptions) -> None:
    _KERNEL.configure(options)
    _ready.cache_clear()


@cache
def _ready() -> ctypes.CDLL | None:
    lib = load()
    if lib is None or library_isa(lib) != "amx":
        return None
    return lib if lib.amx_ready() == 1 else None


def available() -> bool:
    """Whether the AMX GEMM runs here: built with AMX, tile state granted, one product right."""
    return _ready() is not None


def tile_peak(threads: int, seconds: float = 0.2, repetitions: int = 5) -> float | None:
    """bf16 flops a second AMX's tiles issue on `threads` threads (TDPBF16PS on registers): the
    best of `repetitions` runs of about `seconds`; None where the AMX GEMM does not run."""
    lib = _ready()
    if lib is None:
        return None
    return best_rate(
        lambda iters: lib.amx_tile_flops(iters, threads), 1 << 12, seconds, repetitions
    )


@dataclass(frozen=True)
class AmxPacked:
    """A Q4_1 weight [out, in] in the kernel's layout (cpu_amx_gemm.c): B tiles' codes, the d of
    each lane, the m rows; out padded to a multiple of 2 * PANEL with zero weights."""

    nib: Tensor  # [panels, nb, 16, 16] uint8
    dv: Tensor  # [panels, nb, 32] fp32
    mv: Tensor  # [panels, ne, 16, 32] fp32
    out_features: int
    in_features: int


def pack(blocks: Tensor) -> AmxPacked:
    """Held Q4_1 blocks [out, in / 32 * 24] uint8 -> the kernel's layout (once, at load)."""
    out_features = blocks.shape[0]
    in_features = blocks.shape[1] // BLOCK_BYTES["q4_1"] * 32
    check_blocks(blocks, "q4_1", in_features)
    nb = in_features // 32
    ne = -(-nb // 32)
    padded = -(-out_features // (2 * PANEL)) * 2 * PANEL
    panels = padded // PANEL
    b = blocks.reshape(out_features, nb, BLOCK_BYTES["q4_1"])
    d = torch.zeros(padded, nb)
    m = torch.zeros(padded, ne * 32)
    d[:out_features] = b[..., 0:4].contiguous().view(torch.float32)[..., 0]
    m[:out_features, :nb] = b[..., 4:8].contiguous().view(torch.float32)[..., 0]
    qs = b[..., Q4_1_CODES:]
    q = torch.zeros(padded, nb, 32, dtype=torch.uint8)
    q[:out_features] = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [out, nb, 32]: code of k
    # a B tile's row i, lane j = 2 n + p: code k = 2 i + p of feature n
    lanes = q.view(panels, PANEL, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(panels, nb, 16, 32)
    nib = (lanes[..., :16] | (lanes[..., 16:] << 4)).contiguous()
    dv = d.view(panels, PANEL, nb).permute(0, 2, 1).repeat_interleave(2, dim=-1).contiguous()
    mv = m.view(panels, PANEL, ne, 16, 2).permute(0, 2, 3, 1, 4).reshape(panels, ne, 16, 32)
    return AmxPacked(nib, dv, mv.contiguous(), out_features, in_features)


def amx_gemm(
    x: Tensor,  # [rows, in] fp32, rows >= 1; each row contiguous
    packed: AmxPacked,
    out: Tensor | None = None,  # [rows, out] fp32, rows contiguous; default: a new tensor
) -> Tensor:
    """x @ W.T for the Q4_1 weight W [out, in] that `packed` holds, in fp32 -> [rows, out]."""
    lib = _ready()
    if lib is None:
        raise RuntimeError("the AMX GEMM does not run here (see available() and the log)")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(
            f"x must be a 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    rows, in_features = x.shape
    if rows < 1 or x.stride(1) != 1:
        raise ValueError(f"x needs rows (got {rows}), each contiguous")
    if in_features != packed.in_features:
        raise ValueError(f"x has {in_features} features, the weight takes {packed.in_features}")
    if out is None:
        out = torch.empty(rows, packed.out_features, dtype=torch.float32)
    elif (
        out.dtype != torch.float32
        or tuple(out.shape) != (rows, packed.out_features)
        or out.stride(1) != 1
    ):
        raise ValueError(f"out must be a [{rows}, {packed.out_features}] float32 tensor")
    status = lib.amx_gemm_q4_1(
        packed.nib.data_ptr(),
        packed.dv.data_ptr(),
        packed.mv.data_ptr(),
        packed.out_features,
        in_features,
        x.data_ptr(),
        x.stride(0),
        rows,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError(f"amx_gemm_q4_1: no memory to pack {rows} x {in_features} inputs")
    assert status == 0, f"amx_gemm_q4_1 refused a shape the wrapper checked: {tuple(x.shape)}"
    return out


@dataclass(frozen=True)
class ScreenPacked:
    """A Q8_0 head [vocab, hidden] rounded per vocabulary row for the int8 tiles
    (cpu_amx_gemm.c amx_screen): vocab padded to a multiple of 32, hidden to one of 64."""

    wq: Tensor  # [groups, k_tiles, 16, 64] int8: B tiles
    wv: Tensor  # [4, groups * 16] fp32: s_v, sum|w_v|, max|w_v - s_v w'_v|, |w_v|_2
    vocab: int
    hidden: int

    @property
    def padded_vocab(self) -> int:
        return self.wv.shape[1]


def pack_screen(blocks: Tensor) -> ScreenPacked:
    """Held Q8_0 blocks [vocab, hidden / 32 * 34] uint8 -> the screen's layout (once, at load).
    The rows' terms are computed in float64 and rounded up to fp32: they bound errors. Raises
    ValueError for a block's scale that is not finite."""
    from kernels.cpu_quant_gemv import dequantize

    vocab, hidden = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES["q8_0"] * 32
    check_blocks(blocks, "q8_0", hidden)
    w = dequantize(blocks, "q8_0").double()  # d * q: exact in fp32, so in float64
    if not bool(torch.isfinite(w).all()):
        raise ValueError("a Q8_0 block's scale is not finite")
    scale = (w.abs().amax(1) / 127).float()  # the fp32 scale the kernel multiplies by
    s64 = scale.double()
    codes = torch.where(s64[:, None] > 0, torch.round(w / s64.clamp_min(1e-300)[:, None]), 0.0)
    codes = codes.clamp(-127, 127)
    up = 1.0 + 2.0**-20
    terms = torch.stack([
        scale.double(),
        w.abs().sum(1) * up,
        (w - s64[:, None] * codes).abs().amax(1) * up,
        w.norm(dim=1) * up,
    ]).float()  # fmt: skip
    padded = -(-vocab // 32) * 32
    k_pad = -(-hidden // 64) * 64
    q = torch.zeros(padded, k_pad, dtype=torch.int8)
    q[:vocab, :hidden] = codes.to(torch.int8)
    wv = torch.zeros(4, padded)
    wv[:, :vocab] = terms
    # a B tile's row i, byte 4 n + j: code of vocab row 16 g + n, input 64 t + 4 i + j
    wq = q.view(padded // 16, 16, k_pad // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()
    return ScreenPacked(wq, wv, vocab, hidden)


def amx_screen(packed: ScreenPacked, x: Tensor, hi: Tensor, lo_max: Tensor) -> bool:
    """Each row of x's upper bounds [rows, padded_vocab] into hi and greatest lower bound into
    lo_max [rows] (cpu_amx_gemm.c); False where x holds a value that is not finite."""
    lib = _ready()
    if lib is None:
        raise RuntimeError("the AMX screen does not run here (see available() and the log)")
    rows = x.shape[0]
    if x.dtype != torch.float32 or tuple(x.shape) != (rows, packed.hidden) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [rows, {packed.hidden}] float32 tensor")
    if hi.stride() != (packed.padded_vocab, 1) or hi.shape[0] < rows or lo_max.shape[0] < rows:
        raise ValueError(f"hi needs [{rows}, {packed.padded_vocab}] rows, lo_max [{rows}]")
    status = lib.amx_screen(
        packed.wq.data_ptr(), packed.wv.data_ptr(), packed.vocab, packed.hidden, x.data_ptr(),
        rows, hi.data_ptr(), lo_max.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == -3:
        raise MemoryError(f"amx_screen: no memory for {rows} rows")
    return status == 0
