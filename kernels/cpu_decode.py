"""The fused fp32 decode forward (cpu_decode.c), built once per machine.

A step of at most MAX_ROWS tokens on an fp32 GGUF model (decode rows, speculative drafts, short
prefill chunks) runs every decoder layer in one C call and one OpenMP region: the block GEMV of
each linear (cpu_quant_dot.h, the sums of kernels/cpu_quant_gemv.py bit for bit), and the norms,
RoPE, K/V writes, attention and SwiGLU in fp32 between them, without the torch path's ~300 small
ops, casts and allocations a step. The KV cache is fp32 or fp16 (KV_DTYPES): fp16 K and V are
rounded once as they are stored, as torch's .to(float16) rounds them, and read back widened. `DecodeForward` holds a model's layers as the kernel's table
of pointers and a preallocated work buffer. Its build and instruction-set levels are the GEMV's
(AVX-512, AVX2 + FMA + F16C, plain C, chosen from the CPU's features at run time).
No compiler, or `enabled=False`: `load()` returns None and the model runs layer by layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

from kernels import cbuild, cpu_quant_gemv
from kernels.cpu_quant_gemv import BLOCK_SIZE, BlockKind

SOURCE = Path(__file__).with_name("cpu_decode.c")
_INDEX_DTYPES = (torch.int64, torch.int64, torch.int32, torch.int32)
MAX_ROWS = 32  # a step's tokens; the engine's GEMV regime (engine/gguf_linear.GEMV_MAX_ROWS)
MAX_HEAD_DIM, MAX_GROUP = 256, 16

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_i32, _ptr, _ptr, _i32, _i32, _i32, _i32, _i32, _f32, _ptr, _i32, _ptr, _ptr, _i32]
_ARGTYPES += [_ptr, _ptr, _i64, _i32, _i32, _ptr, _i32, _i64, _ptr, _ptr, _f32, _ptr, _i32, _i64]
KV_DTYPES = (torch.float32, torch.float16)  # the caches it reads and writes; fp16: rounded once
# How long a thread that has taken a phase's last item waits for the others' before it redoes
# what they still hold (a thread a stage preempted): a phase at 8 rows takes ~45 us, the threads'
# natural skew a few. The engine alone and beside the pipeline: docs/benchmarks.md.
REDO_AFTER_NS = 30_000


class DecodeOptions(cbuild.KernelOptions):
    """The switch (EngineConfig.fused_decode), the compiler and cache, a forced level."""

    LEVELS = cpu_quant_gemv.ISA_LEVELS


def _bind(lib: ctypes.CDLL) -> None:
    lib.decode_forward_f32.argtypes = _ARGTYPES
    lib.decode_forward_f32.restype = ctypes.c_int
    lib.decode_counters.argtypes = [_ptr]
    lib.decode_counters.restype = None


_KERNEL = cbuild.CKernel(
    title="the fused CPU decode forward",
    source=SOURCE,
    levels=cpu_quant_gemv.LEVELS,
    flag_sets=cpu_quant_gemv.FLAG_SETS,
    bind=_bind,
    fallback="fp32 decode steps run layer by layer",
    options=DecodeOptions(),
)
configure = _KERNEL.configure
chosen_isa = _KERNEL.chosen_isa
load = _KERNEL.load
library_isa = cpu_quant_gemv.LEVELS.of


def available() -> bool:
    return load() is not None


@dataclass(frozen=True)
class Counters:
    """What the fused forward's items cost beyond their work, since the kernel loaded: a thread
    that runs out of items waits for the phase's last stores (`num_waits`, `wait_ns`; waits
    past 32 pauses), redoing what is still open after REDO_AFTER_NS, and an item computed by
    two threads is dropped by the one that stores second (`num_dropped`: work done twice)."""

    num_calls: int = 0
    num_thread_calls: int = 0
    num_dropped: int = 0
    num_waits: int = 0
    wait_ns: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def counters(lib: ctypes.CDLL | None = None) -> Counters:
    """The counters of the loaded kernel (all zero when it is not loaded)."""
    lib = lib or load()
    if lib is None:
        return Counters()
    out = (ctypes.c_int64 * len(fields(Counters)))()  # decode_counters' C_COUNT
    lib.decode_counters(out)
    return Counters(*out)


@dataclass(frozen=True)
class Linear:
    blocks: Tensor  # [out, in / 32 * block_bytes] uint8, contiguous
    kind: BlockKind


@dataclass(frozen=True)
class LayerWeights:
    qkv: Linear  # rows q, k, v
    o: Linear
    gate_up: Linear  # rows gate, then up
    down: Linear
    input_norm: Tensor  # [hidden] fp32
    post_norm: Tensor  # [hidden] fp32


@dataclass(frozen=True)
class Shape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    eps: float

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def work_per_row(self) -> int:  # h, qkv, attention out, gate and up
        return self.hidden + self.qkv_size + self.num_heads * self.head_dim + 2 * self.ffn

    def refusal(self) -> str | None:
        """Why the kernel cannot take this shape, or None."""
        d, h, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        if d > MAX_HEAD_DIM or d % 2:
            return f"head_dim {d}: the fused forward takes even head dims up to {MAX_HEAD_DIM}"
        if h % kvh or h // kvh > MAX_GROUP:
            return f"{h} heads over {kvh} KV heads: at most {MAX_GROUP} query heads a KV head"
        for name, n in (("hidden", self.hidden), ("heads * head_dim", h * d), ("ffn", self.ffn)):
            if n % BLOCK_SIZE:
                return f"{name} {n} is not a multiple of {BLOCK_SIZE}"
        return None


class DecodeForward:
    """A model's decoder layers as the fused kernel's table: `forward` runs all of them for a
    step of at most MAX_ROWS tokens, updating the residual stream `x` in place."""

    def __init__(self, shape: Shape, layers: list[LayerWeights]) -> None:
        refusal = shape.refusal()
        if refusal:
            raise ValueError(refusal)
        s = shape
        want = {
            "qkv": (s.qkv_size, s.hidden),
            "o": (s.hidden, s.num_heads * s.head_dim),
            "gate_up": (2 * s.ffn, s.hidden),
            "down": (s.hidden, s.ffn),
        }
        for i, layer in enumerate(layers):
            for name, (out, inp) in want.items():
                lin: Linear = getattr(layer, name)
                cpu_quant_gemv.check_blocks(lin.blocks, lin.kind, inp)
                if lin.blocks.shape[0] != out:
                    raise ValueError(f"layer {i} {name}: {lin.blocks.shape[0]} rows, want {out}")
            for norm in (layer.input_norm, layer.post_norm):
                if norm.dtype != torch.float32 or tuple(norm.shape) != (s.hidden,):
                    raise ValueError(f"layer {i}: norms must be [{s.hidden}] float32")
        self.shape, self.layers = shape, layers
        self.scale = shape.head_dim**-0.5
        kinds = [[int(getattr(ly, n).kind == "q8_0") for n in want] for ly in layers]
        self.kinds = torch.tensor(kinds, dtype=torch.int32)  # [L, 4]
        self.work = torch.empty(MAX_ROWS * shape.work_per_row, dtype=torch.float32)
        self._table: Tensor | None = None  # [L, 8] int64 pointers, for the caches below
        self._caches: list[tuple[Tensor, Tensor]] | None = None

    def _pointers(self, kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        if self._caches is not kv_caches or self._table is None:
            if len(kv_caches) != len(self.layers):
                raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
            rows = []
            s = self.shape
            shape = (*kv_caches[0][0].shape[:2], s.num_kv_heads, s.head_dim)  # [NB, BS, KVH, D]
            dtype = kv_caches[0][0].dtype
            if dtype not in KV_DTYPES:
                raise ValueError(f"KV caches of {dtype}: the fused forward takes {KV_DTYPES}")
            for ly, (k, v) in zip(self.layers, kv_caches, strict=True):
                for c in (k, v):
                    if c.dtype != dtype or not c.is_contiguous() or c.device.type != "cpu":
                        raise ValueError(
                            f"the fused forward needs contiguous CPU KV caches, all {dtype}"
                        )
                    if tuple(c.shape) != shape:  # the kernel takes every layer's pool as one
                        raise ValueError(
                            f"KV caches of {tuple(c.shape)}: every one must be {shape}"
                        )
                lins = (ly.qkv, ly.o, ly.gate_up, ly.down)
                rows.append([lin.blocks.data_ptr() for lin in lins] + [
                    ly.input_norm.data_ptr(), ly.post_norm.data_ptr(), k.data_ptr(), v.data_ptr()
                ])  # fmt: skip
            self._table, self._caches = torch.tensor(rows, dtype=torch.int64), kv_caches
        return self._table

    def forward(
        self,
        x: Tensor,  # [T, hidden] fp32 contiguous, T <= MAX_ROWS: in and out
        cos: Tensor,  # [max_pos, head_dim] fp32 contiguous
        sin: Tensor,  # [max_pos, head_dim], the sign of the first half folded in
        positions: Tensor,  # [T] int64
        slots: Tensor,  # [T] int64
        kv_caches: list[tuple[Tensor, Tensor]],  # per layer [blocks, block_size, KVH, D]
        block_tables: Tensor,  # [S, W] int32 contiguous
        seq_idx: Tensor,  # [T] int32: each token's row of block_tables
        ctx_len: Tensor,  # [T] int32: keys it attends, its position + 1
        lib: ctypes.CDLL | None = None,
        redo_after_ns: int | None = None,  # default REDO_AFTER_NS; 0: every waiting thread races
    ) -> Tensor:
        lib = lib or load()
        redo_after_ns = REDO_AFTER_NS if redo_after_ns is None else redo_after_ns
        if lib is None:
            raise RuntimeError("the fused CPU decode forward is not available (see the log)")
        t, s = x.shape[0], self.shape
        if (
            x.dim() != 2
            or x.shape[1] != s.hidden
            or not 1 <= t <= MAX_ROWS
            or x.dtype != torch.float32
            or not x.is_contiguous()
        ):
            raise ValueError(f"x must be [1..{MAX_ROWS}, {s.hidden}] contiguous float32")
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != s.head_dim:
                raise ValueError(f"{name} must be [max_pos, {s.head_dim}] float32")
            if not table.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        index = (positions, slots, seq_idx, ctx_len)
        if any(i.shape != (t,) or not i.is_contiguous() for i in index):
            raise ValueError(f"positions, slots, seq_idx and ctx_len must be [{t}] contiguous")
        if (positions.dtype, slots.dtype, seq_idx.dtype, ctx_len.dtype) != _INDEX_DTYPES:
            raise ValueError("positions and slots must be int64, seq_idx and ctx_len int32")
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            raise ValueError("block_tables must be contiguous int32")
        table = self._pointers(kv_caches)
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        status = lib.decode_forward_f32(
            len(self.layers),
            table.data_ptr(),
            self.kinds.data_ptr(),
            s.hidden,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.ffn,
            s.eps,
            x.data_ptr(),
            t,
            cos.data_ptr(),
            sin.data_ptr(),
            min(cos.shape[0], sin.shape[0]),
            positions.data_ptr(),
            slots.data_ptr(),
            num_blocks,
            block_size,
            int(kv_caches[0][0].dtype == torch.float16),
            block_tables.data_ptr(),
            block_tables.shape[0],
            block_tables.shape[1],
            seq_idx.data_ptr(),
            ctx_len.data_ptr(),
            self.scale,
            self.work.data_ptr(),
            torch.get_num_threads(),
            redo_after_ns,
        )
        if status == -2:
            raise MemoryError("the fused CPU decode forward could not allocate its scratch")
        if status == -3:
            raise IndexError(
                "a position, slot, sequence or block id of the step is out of range "
                f"({num_blocks} blocks of {block_size}, {cos.shape[0]} positions): nothing written"
            )
        assert status == 0, f"decode_forward_f32 refused a shape the wrapper checked: {s}"
        return x
