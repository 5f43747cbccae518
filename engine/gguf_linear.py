"""fp32 linears that keep a GGUF tensor's Q4_1 / Q8_0 blocks beside the dense weight.

Steps of at most GEMV_MAX_ROWS rows run the compiled block GEMV (kernels/cpu_quant_gemv.py),
steps of more rows (batched decode, prefill chunks) the compiled block GEMM
(kernels/cpu_quant_gemm.py): the same fp32 weights, rebuilt from 0.75 / 1.0625 bytes a weight
instead of 4, fp32 sums, so the logits are the dense fp32 path's up to summation order. The GEMM
beat the dense fp32 GEMM at every row count measured (9 to 512, docs/benchmarks.md); the dense
weight serves only where the GEMM could not be built, and is dropped where it was (it is 4 bytes
a weight: ~540 MB of SmolLM2-135M's fp32 engine). Blocks are as the kernels hold them
(kernels/cpu_quant_gemv.py from_gguf: Q8_0 as GGUF stores it, Q4_1 with fp32 scales), one row
of blocks per output feature. In the batch-invariant mode every step runs the GEMV, its rows in
groups of 8 (it sums a row the same way whatever shares the step), so a row's result never depends
on the step's row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels import cpu_amx_gemm, cpu_quant_gemm, cpu_quant_gemv
from kernels.cpu_quant_gemv import BlockKind


@dataclass(frozen=True)
class GGUFBlocks:
    """A weight [out, in] as GGUF blocks: `data` [out, in / 32 * block_bytes] uint8."""

    kind: BlockKind
    data: Tensor

    def __post_init__(self) -> None:
        assert self.kind in cpu_quant_gemv.BLOCK_BYTES, f"block kind {self.kind!r}"
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2, "blocks: 2-D uint8"

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // cpu_quant_gemv.BLOCK_BYTES[self.kind] * 32


def concat_blocks(parts: list[GGUFBlocks | None]) -> GGUFBlocks | None:
    """The row concatenation of `parts` (fused q/k/v, gate/up); None unless all are blocks of
    one kind and width (a file may store one of them in another type)."""
    if any(p is None for p in parts):
        return None
    kinds = {(p.kind, p.data.shape[1]) for p in parts}
    if len(kinds) != 1:
        return None
    return GGUFBlocks(parts[0].kind, torch.cat([p.data for p in parts]).contiguous())


# The GEMV (rows in groups of 8 inside each tile of weights) against the GEMM, the engine's decode
# steps side by side on the quiet machine (2026-12-01): 16 rows 452-478 vs 579-597 tok/s, 24 rows
# 622-651 vs 680-700, 32 rows 624-771 vs 672-681 (a tie): the GEMV up to 32 rows, the GEMM above.
GEMV_MAX_ROWS = 32


class GGUFLinear(nn.Module):
    """The block GEMV for steps of at most GEMV_MAX_ROWS fp32 rows, the block GEMM above
    (`gemm`: it was built), `dense` otherwise; `invariant`: the GEMV at every row count. With
    the GEMM, or in the invariant mode, no step needs `dense`, and it is not kept. `amx`: Q4_1
    steps above GEMV_MAX_ROWS go through the AMX GEMM where it runs (kernels/cpu_amx_gemm.py;
    its own copy of the weights, packed for the tiles: 0.75 bytes a weight)."""

    def __init__(
        self,
        blocks: GGUFBlocks,
        dense: nn.Module,
        *,
        gemm: bool | None = None,
        invariant: bool = False,
        amx: bool = False,
    ) -> None:
        super().__init__()
        if blocks.data.shape[0] != dense.out_features:
            raise ValueError(
                f"{blocks.data.shape[0]} rows of blocks for {dense.out_features} output features"
            )
        self.kind = blocks.kind
        self.register_buffer("blocks", blocks.data.contiguous())
        self.out_features = dense.out_features
        self.gemm = cpu_quant_gemm.available() if gemm is None else gemm
        self.invariant = invariant
        self.dense: nn.Module | None = None if (self.gemm or invariant) else dense
        self.amx: cpu_amx_gemm.AmxPacked | None = None
        if amx and not invariant and self.kind == "q4_1" and cpu_amx_gemm.available():
            self.amx = cpu_amx_gemm.pack(self.blocks)

    def forward(self, x: Tensor) -> Tensor:  # [n, in] -> [n, out]
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.out_features)
        if x.dtype != torch.float32:  # the model is fp32; a caller's other dtype, in and out
            return self.forward(x.float()).to(x.dtype)
        if rows > GEMV_MAX_ROWS and self.dense is not None:  # no GEMM here
            return self.dense.forward(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if rows <= GEMV_MAX_ROWS or self.invariant:
            return cpu_quant_gemv.quant_gemv(x, self.blocks, self.kind)
        if self.amx is not None:
            return cpu_amx_gemm.amx_gemm(x, self.amx)
        return cpu_quant_gemm.quant_gemm(x, self.blocks, self.kind)


def with_blocks(
    dense: nn.Module, blocks: GGUFBlocks | None, invariant: bool = False, amx: bool = False
) -> nn.Module:
    """`dense` itself without blocks, else a GGUFLinear over both (`invariant`: the GEMV at
    every row count; `amx`: the AMX GEMM above it, where it runs)."""
    return dense if blocks is None else GGUFLinear(blocks, dense, invariant=invariant, amx=amx)
