"""The compiled GGUF-block GEMM against its pure-torch reference at each instruction-set level,
over every row count from 1 to 600 and odd shapes.

Tolerance (fp32), as for the GEMV: |kernel - reference| <= 1e-5 + 1e-5 * (|x| @ |W|.T),
elementwise; the two differ only in summation order. A row's result is one chain of fp32 FMAs
whatever shares the call, so rows are compared bit for bit across row counts and thread counts.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cbuild
from kernels import cpu_quant_gemm as qm
from kernels import cpu_quant_gemv as qv
from kernels.cpu_quant_gemm import GemmOptions
from tests.kernels.test_cpu_quant_gemv import assert_matches_reference, random_blocks

pytestmark = pytest.mark.skipif(not qm.available(), reason="no C compiler to build the kernel")
HERE = qv.cpu_flags()
# chunk and super-block edges of every level: 16 / 48 rows a chunk, 96 / 112 rows a super-block
ROW_COUNTS = (1, 2, 8, 9, 15, 16, 17, 31, 33, 47, 48, 49, 95, 97, 113, 127, 600)


def forced(level: str):
    """The library load() gives with `level` forced, or a skip where this CPU lacks it."""
    if not qv.ISA_NEEDS[level] <= HERE and qv.is_x86():
        pytest.skip(f"this CPU lacks {sorted(qv.ISA_NEEDS[level] - HERE)}")
    qm.configure(GemmOptions(isa=level))
    lib = qm.load()
    assert lib is not None
    if qv.is_x86():
        assert qm.library_isa(lib) == level  # the path it was asked for
    return lib


@pytest.fixture(params=qv.ISA_LEVELS)
def level_lib(request):
    try:
        yield forced(request.param)
    finally:
        qm.configure(GemmOptions())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(32, 1), (64, 3), (576, 577), (1536, 100)]
)
def test_each_forced_level_matches_the_reference(level_lib, kind, in_features, out_features):
    blocks = random_blocks(kind, out_features, in_features, seed=in_features + out_features)
    gen = torch.Generator().manual_seed(out_features)
    xs = torch.randn(max(ROW_COUNTS), in_features, generator=gen)
    full = qm.quant_gemm(xs, blocks, kind, lib=level_lib)
    assert_matches_reference(xs, blocks, kind, full)
    for rows in ROW_COUNTS:
        got = qm.quant_gemm(xs[:rows], blocks, kind, lib=level_lib)
        assert got.shape == (rows, out_features)
        assert torch.equal(got, full[:rows]), f"{rows} rows: a row changed with the row count"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_every_row_count_from_1_to_600(level_lib, kind):
    blocks = random_blocks(kind, 37, 96, seed=5)
    xs = torch.randn(600, 96, generator=torch.Generator().manual_seed(5))
    want = qm.quant_gemm_reference(xs, blocks, kind)
    magnitude = xs.abs() @ qv.dequantize(blocks, kind).abs().t()
    full = qm.quant_gemm(xs, blocks, kind, lib=level_lib)
    assert ((full - want).abs() <= 1e-5 + 1e-5 * magnitude).all()
    for rows in range(1, 601):
        start = (7 * rows) % (601 - rows)  # the rows at another offset too
        got = qm.quant_gemm(xs[start : start + rows], blocks, kind, lib=level_lib)
        assert torch.equal(got, full[start : start + rows]), f"{rows} rows from {start}"


def test_strided_rows_an_out_buffer_and_the_thread_count_change_no_bit():
    blocks = random_blocks("q4_1", 1537, 576, seed=1)
    wide = torch.randn(70, 2 * 576, generator=torch.Generator().manual_seed(1))
    x = wide[:, 100 : 100 + 576]  # each row contiguous, rows 1152 apart
    got = qm.quant_gemm(x, blocks, "q4_1")
    assert_matches_reference(x, blocks, "q4_1", got)
    assert torch.equal(got, qm.quant_gemm(x.contiguous(), blocks, "q4_1"))
    out = torch.full((70, 2000), float("nan"))[:, :1537]
    assert qm.quant_gemm(x, blocks, "q4_1", out=out) is out
    assert torch.equal(out, got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qm.quant_gemm(x, blocks, "q4_1"), got)
        torch.set_num_threads(3)  # more threads than cores: panels split unevenly
        assert torch.equal(qm.quant_gemm(x, blocks, "q4_1"), got)
    finally:
        torch.set_num_threads(threads)


def test_rejects_what_it_cannot_compute():
    blocks = random_blocks("q4_1", 8, 64)
    x = torch.randn(20, 64)
    with pytest.raises(ValueError, match="float32"):
        qm.quant_gemm(x.bfloat16(), blocks, "q4_1")
    with pytest.raises(ValueError, match="no rows"):
        qm.quant_gemm(torch.randn(0, 64), blocks, "q4_1")
    with pytest.raises(ValueError, match="take 68 bytes a row, got 48"):
        qm.quant_gemm(x, blocks, "q8_0")
    with pytest.raises(ValueError, match="rows must be contiguous"):
        qm.quant_gemm(torch.randn(64, 20).t(), blocks, "q4_1")
    with pytest.raises(ValueError, match="block kind"):
        qm.quant_gemm(x, blocks, "q4_0")
    with pytest.raises(ValueError, match=r"\[20, 8\] float32"):
        qm.quant_gemm(x, blocks, "q4_1", out=torch.empty(20, 9))


def test_a_level_the_cpu_lacks_is_refused_and_no_compiler_gives_none(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(cbuild, "cpu_flags", lambda cpuinfo=None: frozenset({"sse2"}))
    monkeypatch.setattr(cbuild, "is_x86", lambda: True)
    assert qm.chosen_isa() == "none"  # the level these flags allow
    qm.configure(GemmOptions(isa="avx512"))
    try:
        assert qm.load() is None  # never run
        assert "needs CPU features this CPU lacks (avx2, avx512bw" in caplog.text
        qm.configure(GemmOptions(compiler="false", cache_root=tmp_path))
        assert qm.load() is None
        assert "could not build the CPU quantized GEMM kernel" in caplog.text
        with pytest.raises(RuntimeError, match="not available"):
            qm.quant_gemm(torch.randn(9, 32), random_blocks("q8_0", 1, 32), "q8_0")
    finally:
        qm.configure(GemmOptions())
    monkeypatch.undo()
    assert qm.available()
