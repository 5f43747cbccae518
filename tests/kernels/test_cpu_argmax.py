"""The compiled greedy argmax against torch.argmax at each instruction-set level: the same index
for every row, ties (the first), infinities and NaN (the first NaN) included."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_argmax
from kernels import cpu_quant_gemv as qg
from kernels.cpu_quant_gemv import GemvOptions

pytestmark = pytest.mark.skipif(cpu_argmax.load() is None, reason="no C compiler to build it")
HERE = qg.cpu_flags()


def forced(level: str):
    if not qg.ISA_NEEDS[level] <= HERE and qg.is_x86():
        pytest.skip(f"this CPU lacks {sorted(qg.ISA_NEEDS[level] - HERE)}")
    cpu_argmax.configure(GemvOptions(isa=level))
    lib = cpu_argmax.load()
    assert lib is not None
    if qg.is_x86():
        assert qg.library_isa(lib) == level
    return lib


def hard_rows(n: int) -> torch.Tensor:
    """Rows that catch a wrong scan: ties of the max early and late, the max in the last lane
    and past the last whole vector, -inf everywhere, +inf, NaN early and late, signed zeros."""
    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=gen) for _ in range(12)]
    rows[0][[n // 3, n - 1]] = 9.0  # a tie: the first wins
    rows[1][n - 1] = 9.0  # the last element
    rows[2][:] = float("-inf")
    rows[3][n // 2 :] = float("inf")
    rows[4][n - 1] = float("nan")
    rows[5][[0, n // 2]] = float("nan")
    rows[6][:] = -0.0
    rows[6][n // 2 :] = 0.0  # -0.0 == 0.0: index 0
    rows[7][:] = 1.0  # all equal
    rows[8][n // 2] = float("nan")
    rows[8][n // 4] = float("inf")  # NaN beats inf
    rows[9] = torch.arange(n, dtype=torch.float32)  # ascending: the last
    rows[10] = -torch.arange(n, dtype=torch.float32)  # descending: the first
    return torch.stack(rows)


@pytest.mark.parametrize("level", qg.ISA_LEVELS)
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 63, 64, 65, 130, 49152])
def test_each_forced_level_gives_torch_argmax(level, n):
    try:
        forced(level)
        gen = torch.Generator().manual_seed(n)
        for rows in (1, 3, 33):
            x = torch.randn(rows, n, generator=gen) * 10
            assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
        x = hard_rows(n)
        got = cpu_argmax.argmax_rows(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(dim=-1)), (got.tolist(), x.argmax(dim=-1).tolist())
    finally:
        cpu_argmax.configure(GemvOptions())


def test_the_tie_and_nan_rules_are_torchs():
    x = hard_rows(100)
    got = cpu_argmax.argmax_rows(x).tolist()
    assert got[0] == 33 and got[1] == 99 and got[2] == 0 and got[3] == 50
    assert got[4] == 99 and got[5] == 0 and got[6] == 0 and got[7] == 0 and got[8] == 50
    assert got[9] == 99 and got[10] == 0


def test_strided_rows_take_the_kernel_and_other_tensors_torch():
    big = torch.randn(5, 200)
    view = big[:, 3:150]  # rows 200 apart, columns contiguous
    assert torch.equal(cpu_argmax.argmax_rows(view), view.argmax(dim=-1))
    cols = big.t()  # columns strided: torch's path
    assert torch.equal(cpu_argmax.argmax_rows(cols), cols.argmax(dim=-1))
    for other in (big.double(), big.half(), big[:0]):
        assert torch.equal(cpu_argmax.argmax_rows(other), other.argmax(dim=-1))


def test_without_a_compiler_it_is_torch_argmax(tmp_path):
    cpu_argmax.configure(GemvOptions(compiler="false", cache_root=tmp_path))
    try:
        assert cpu_argmax.load() is None
        x = hard_rows(70)
        assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    finally:
        cpu_argmax.configure(GemvOptions())
    assert cpu_argmax.load() is not None
