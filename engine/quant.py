"""Linear layers: dense, or weight-only int8 / int4 quantized for fast CPU decode.

A decode step reads every weight once, so on the CPU its time is the bytes of the weights:
int8 per-output-channel (`torch._weight_int8pack_mm`) and int4 with asymmetric groups of 32
(`torch._weight_int4pack_mm_for_cpu`) cut them 2x / 4x against bf16. Activations stay in the
model dtype (bf16 activations are what make the int8 kernel fast). These kernels are GEMVs:
past ~8 rows dense bf16 GEMMs win, so the "-decode" variants keep both and pick per step.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Quantization = Literal["int8", "int4", "int8-decode", "int4-decode"]
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4", "int8-decode", "int4-decode")
INT4_GROUP_SIZE = 32
DECODE_MAX_ROWS = 8  # measured crossover: at 8 rows int4 and dense bf16 tie, at 32 dense is 2x


class DenseLinear(nn.Module):
    def __init__(self, weight: Tensor) -> None:  # [out, in]
        super().__init__()
        self.register_buffer("weight", weight)
        self.out_features = weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:  # [n, in] -> [n, out]
        return F.linear(x, self.weight)


class TwoRowLinear(nn.Module):
    """The batch-invariant mode's linear: a one-row input is computed as two copies of the row.
    The CPU's bf16 GEMM gives a row the same bits at every row count from 2 up, but its one-row
    path sums in another order (measured: a row of a SmolLM2 down_proj differed). Two rows cost
    what one does (the weights are read once either way)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.out_features = inner.out_features

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] == 1:
            return self.inner.forward(x.expand(2, -1).contiguous())[:1]
        return self.inner.forward(x)


class Int8Linear(nn.Module):
    """Symmetric per-output-channel int8: w ~ q * scale[out]."""

    def __init__(self, weight: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [out]
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.out_features = weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scales)


class Int4Linear(nn.Module):
    """Asymmetric int4 in groups of 32 along `in`: w ~ (q - 8) * scale + zero, q in [0, 15].

    GGUF's Q4_1 is the same scheme (w = q * d + m, min -> 0, max -> 15), so re-quantizing a
    Q4_1 tensor recovers its own codes.
    """

    def __init__(self, weight: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        g = INT4_GROUP_SIZE
        w = weight.float().reshape(out_features, in_features // g, g)  # [out, in/g, g]
        w_min, w_max = torch.aminmax(w, dim=2)  # [out, in/g]
        scales = (w_max - w_min).div_(15.0).clamp_min_(1e-8)
        q = (w - w_min[..., None]).div_(scales[..., None]).round_().clamp_(0, 15)
        q = q.to(torch.int32).view(out_features, in_features)
        zeros = w_min + 8.0 * scales
        self.register_buffer("weight", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # [in/g, out, 2]: (scale, zero) per group and output channel
        scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        self.register_buffer("scales_and_zeros", scales_zeros)
        self.out_features = out_features

    def forward(self, x: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(
            x, self.weight, INT4_GROUP_SIZE, self.scales_and_zeros
        )


class DecodeLinear(nn.Module):
    """Weight-only kernel for steps of at most DECODE_MAX_ROWS rows, dense weights above."""

    def __init__(self, small: nn.Module, dense: DenseLinear) -> None:
        super().__init__()
        self.small, self.dense = small, dense
        self.out_features = dense.out_features

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] <= DECODE_MAX_ROWS:
            return self.small.forward(x)
        return self.dense.forward(x)


def make_linear(
    weight: Tensor,
    *,
    quantization: Quantization | None,
    dtype: torch.dtype,
    batch_invariant: bool = False,
) -> nn.Module:
    """A linear layer over `weight` [out, in] (float, on its final device) in `dtype`.

    int4 needs `in` divisible by 32 and `out` by 16; a matrix that is not falls back to int8.
    batch_invariant: one kernel at every row count (no "-decode" switching), one-row inputs
    computed as two rows, so a row's result never depends on how many share the step.
    """
    if batch_invariant:
        if quantization is not None and quantization.endswith("-decode"):
            raise ValueError(
                f"quantization={quantization!r}; allowed with batch_invariant: None, int8, int4"
            )
        return TwoRowLinear(make_linear(weight, quantization=quantization, dtype=dtype))
    if quantization is None:
        return DenseLinear(weight.to(dtype))
    if quantization in ("int8-decode", "int4-decode"):
        small = make_linear(weight, quantization=quantization[:4], dtype=dtype)
        return DecodeLinear(small, DenseLinear(weight.to(dtype)))
    if weight.device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} uses CPU-only kernels; pass quantization=None on "
            f"{weight.device.type}"
        )
    out_features, in_features = weight.shape
    if quantization == "int4" and in_features % INT4_GROUP_SIZE == 0 and out_features % 16 == 0:
        return Int4Linear(weight, dtype)
    if quantization in ("int8", "int4"):
        return Int8Linear(weight, dtype)
    raise ValueError(f"quantization={quantization!r}; allowed: None, {', '.join(QUANTIZATIONS)}")
