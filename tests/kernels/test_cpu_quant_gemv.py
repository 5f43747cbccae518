"""The compiled GGUF-block GEMV against its pure-torch reference at each instruction-set level,
and the reference's weights against the `gguf` package's own dequantization.

Tolerance (fp32): |kernel - reference| <= 1e-5 + 1e-5 * (|x| @ |W|.T), elementwise: an fp32
sum's rounding scales with the magnitude of its terms, and the two differ only in summation
order (measured: at most ~1.5e-7 of that magnitude). A wrong nibble, scale or offset is O(1).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import cbuild
from kernels import cpu_quant_gemv as qg
from kernels.cpu_quant_gemv import GemvOptions

pytestmark = pytest.mark.skipif(not qg.available(), reason="no C compiler to build the kernel")

GGML_TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
ATOL, RTOL = 1e-5, 1e-5
HERE = qg.cpu_flags()


def random_gguf_blocks(kind: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """[out, in / 32 * gguf_block_bytes] uint8 as a GGUF file stores them: random codes, fp16
    scales (and Q4_1 minimums) of SmolLM2's order of magnitude, a few of them subnormal, zero or
    negative zero."""
    rng = np.random.default_rng(seed)
    nb, nbytes = in_features // 32, qg.GGUF_BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(out_features, nb, nbytes), dtype=np.uint8)
    d = (rng.standard_normal((out_features, nb)) * 0.02).astype(np.float16)
    special = np.array([6e-8, -3e-6, 0.0, -0.0, 6.1e-5], dtype=np.float16)  # subnormals too
    flat = d.reshape(-1)
    flat[: min(flat.size, special.size)] = special[: flat.size]
    raw[..., 0:2] = d.view(np.uint8).reshape(out_features, nb, 2)
    if kind == "q4_1":
        m = (rng.standard_normal((out_features, nb)) * -0.1).astype(np.float16)
        raw[..., 2:4] = m.view(np.uint8).reshape(out_features, nb, 2)
    return raw.reshape(out_features, nb * nbytes)


def random_blocks(kind: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """random_gguf_blocks as the kernels hold them (qg.from_gguf)."""
    raw = random_gguf_blocks(kind, out_features, in_features, seed)
    return qg.from_gguf(torch.from_numpy(raw), kind)


def assert_matches_reference(x: torch.Tensor, blocks: torch.Tensor, kind: str, got: torch.Tensor):
    want = qg.quant_gemv_reference(x, blocks, kind)
    magnitude = x.abs() @ qg.dequantize(blocks, kind).abs().t()  # [rows, out]
    err = (got - want).abs()
    bound = ATOL + RTOL * magnitude
    assert torch.isfinite(got).all()
    assert (err <= bound).all(), f"worst error {float((err - bound).max()):.3g} over the bound"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_reference_weights_are_the_gguf_packages_bit_for_bit(kind):
    raw = random_gguf_blocks(kind, 7, 96, seed=3)
    want = gguf.quants.dequantize(raw, GGML_TYPES[kind]).reshape(7, 96)
    held = qg.from_gguf(torch.from_numpy(raw), kind)
    assert held.shape == (7, 96 // 32 * qg.BLOCK_BYTES[kind])
    got = qg.dequantize(held, kind).numpy()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_from_gguf_widens_q4_1_scales_exactly_and_keeps_the_codes():
    raw = random_gguf_blocks("q4_1", 3, 64, seed=4)
    held = qg.from_gguf(torch.from_numpy(raw), "q4_1").numpy().reshape(3, 2, 24)
    blocks = raw.reshape(3, 2, 20)
    assert np.array_equal(held[..., 8:], blocks[..., 4:])  # the nibbles, untouched
    scales = held[..., :8].copy().view(np.float32)  # [3, 2, 2]: d, m
    assert np.array_equal(scales, blocks[..., :4].copy().view(np.float16).astype(np.float32))
    q8 = torch.from_numpy(random_gguf_blocks("q8_0", 3, 64, seed=4))
    assert torch.equal(qg.from_gguf(q8, "q8_0"), q8)  # Q8_0 is held as GGUF stores it
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        qg.from_gguf(torch.from_numpy(raw[:, :30]), "q4_1")
    with pytest.raises(ValueError, match="block kind 'q4_0'"):
        qg.from_gguf(torch.from_numpy(raw), "q4_0")


def forced(level: str):
    """The library load() gives with `level` forced, or a skip where this CPU lacks it."""
    if not qg.ISA_NEEDS[level] <= HERE and qg.is_x86():
        pytest.skip(f"this CPU lacks {sorted(qg.ISA_NEEDS[level] - HERE)}")
    qg.configure(GemvOptions(isa=level))
    lib = qg.load()
    assert lib is not None
    if qg.is_x86():
        assert qg.library_isa(lib) == level  # the path it was asked for
    return lib


@pytest.mark.parametrize("level", qg.ISA_LEVELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(32, 1), (64, 3), (576, 576), (1536, 1537), (4128, 5)]
)
def test_each_forced_level_matches_the_reference(level, kind, in_features, out_features):
    try:
        lib = forced(level)
        blocks = random_blocks(kind, out_features, in_features, seed=in_features + out_features)
        gen = torch.Generator().manual_seed(out_features)
        # rows in one group, several, a step's panels (7 to 32 rows) and past them; 4128
        # inputs are past the panel's buffer
        xs = torch.randn(qg.MAX_STEP_ROWS + 3, in_features, generator=gen)
        outs = []
        for rows in range(1, len(xs) + 1):
            got = qg.quant_gemv(xs[:rows], blocks, kind, lib=lib)
            assert got.shape == (rows, out_features)
            assert_matches_reference(xs[:rows], blocks, kind, got)
            outs.append(got)
        for rows, got in enumerate(outs, start=1):  # a row's result ignores the other rows
            assert torch.equal(got[0], outs[0][0]), f"row 0 changed with {rows} rows"
        alone = [qg.quant_gemv(xs[i : i + 1], blocks, kind, lib=lib) for i in range(len(xs))]
        assert torch.equal(outs[-1], torch.cat(alone)), "a row changed with its place in a group"
    finally:
        qg.configure(GemvOptions())


def test_strided_rows_an_out_buffer_and_the_thread_count_change_no_bit():
    blocks = random_blocks("q4_1", 1537, 576, seed=1)
    wide = torch.randn(5, 2 * 576, generator=torch.Generator().manual_seed(1))
    x = wide[:, 100 : 100 + 576]  # each row contiguous, rows 1152 apart
    got = qg.quant_gemv(x, blocks, "q4_1")
    assert_matches_reference(x, blocks, "q4_1", got)
    assert torch.equal(got, qg.quant_gemv(x.contiguous(), blocks, "q4_1"))
    out = torch.full((5, 2000), float("nan"))[:, :1537]
    assert qg.quant_gemv(x, blocks, "q4_1", out=out) is out
    assert torch.equal(out, got)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # the rows split over threads, evenly or not: the same bits
            torch.set_num_threads(n)
            assert torch.equal(qg.quant_gemv(x, blocks, "q4_1"), got)
    finally:
        torch.set_num_threads(threads)


def test_rejects_what_it_cannot_compute():
    blocks = random_blocks("q4_1", 8, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="float32"):
        qg.quant_gemv(x.bfloat16(), blocks, "q4_1")
    with pytest.raises(ValueError, match="at least 1"):
        qg.quant_gemv(torch.randn(0, 64), blocks, "q4_1")
    with pytest.raises(ValueError, match="take 68 bytes a row, got 48"):
        qg.quant_gemv(x, blocks, "q8_0")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        qg.quant_gemv(torch.randn(2, 48), blocks[:, :30], "q4_1")
    with pytest.raises(ValueError, match="rows must be contiguous"):
        qg.quant_gemv(torch.randn(64, 2).t(), blocks, "q4_1")
    with pytest.raises(ValueError, match="contiguous"):
        qg.quant_gemv(x, random_blocks("q4_1", 16, 64)[::2], "q4_1")
    with pytest.raises(ValueError, match="block kind"):
        qg.quant_gemv(x, blocks, "q4_0")
    with pytest.raises(ValueError, match=r"\[2, 8\] float32"):
        qg.quant_gemv(x, blocks, "q4_1", out=torch.empty(2, 9))


def test_without_a_compiler_load_returns_none(tmp_path, caplog):
    qg.configure(GemvOptions(compiler="false", cache_root=tmp_path))  # nothing cached: builds
    try:
        assert qg.load() is None
        assert "could not build the CPU quantized GEMV kernel" in caplog.text
        with pytest.raises(RuntimeError, match="not available"):
            qg.quant_gemv(torch.randn(1, 32), random_blocks("q8_0", 1, 32), "q8_0")
        qg.configure(GemvOptions(enabled=False))
        assert not qg.available()
    finally:
        qg.configure(GemvOptions())
    assert qg.available()


def test_each_level_is_chosen_from_the_cpu_flags(monkeypatch, caplog):
    zen4 = frozenset("sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl".split())
    assert qg.best_isa(zen4) == "avx512"
    assert qg.best_isa(frozenset("sse2 avx avx2 fma f16c".split())) == "avx2"
    assert qg.best_isa(frozenset("sse2 avx avx2".split())) == "none"  # no FMA / F16C
    assert qg.best_isa(zen4, x86=False) == "none"
    monkeypatch.setattr(cbuild, "cpu_flags", lambda cpuinfo=None: frozenset({"sse2"}))
    monkeypatch.setattr(cbuild, "is_x86", lambda: True)
    qg.configure(GemvOptions(isa="avx2"))
    try:
        assert qg.load() is None  # a level the CPU lacks is refused, never run
        assert "needs CPU features this CPU lacks (avx2, f16c, fma)" in caplog.text
    finally:
        qg.configure(GemvOptions())
    with pytest.raises(ValueError, match="not one of avx512, avx2, none"):
        GemvOptions(isa="amx")
