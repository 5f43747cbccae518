"""The AMX GEMM over Q4_1 blocks against its pure-torch reference, where AMX runs here; its
layout and its refusal everywhere.

Tolerance (fp32), as for the FMA kernels: |kernel - reference| <= 1e-5 + 1e-5 * (|x| @ |W|.T):
the weights split into bf16 pieces exactly and x keeps 16 significant bits, so each term is
within 2^-14 of |x w|, with unbiased errors that sum as sqrt(K). A row's result is the same sums
whatever shares the call, so rows are compared bit for bit across row counts and thread counts.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cbuild
from kernels import cpu_amx_gemm as ag
from kernels import cpu_quant_gemv as qv
from kernels.cpu_amx_gemm import AmxGemmOptions
from tests.kernels.test_cpu_quant_gemv import assert_matches_reference, random_blocks

needs_amx = pytest.mark.skipif(
    not ag.available(), reason="AMX (tile, bf16) does not run on this CPU, or no compiler"
)
ROW_COUNTS = (1, 2, 15, 16, 17, 31, 32, 33, 47, 95, 97, 257, 600)


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """Held Q4_1 blocks -> q [out, in] uint8, each weight's 4-bit code."""
    b = blocks.reshape(blocks.shape[0], -1, 24)[..., 8:]
    return torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(blocks.shape[0], -1)


def test_pack_lays_each_feature_and_input_where_the_tiles_read_them():
    out_features, in_features = 40, 96  # 2 panel pairs after padding to 64; 3 blocks, 1 m block
    blocks = random_blocks("q4_1", out_features, in_features, seed=5)
    packed = ag.pack(blocks)
    nb = in_features // 32
    assert packed.nib.shape == (4, nb, 16, 16) and packed.dv.shape == (4, nb, 32)
    assert packed.mv.shape == (4, 1, 16, 32)
    q = codes(blocks)
    held = blocks.reshape(out_features, nb, 24)
    d = held[..., 0:4].contiguous().view(torch.float32)[..., 0]
    m = held[..., 4:8].contiguous().view(torch.float32)[..., 0]
    for feature, k in [(0, 0), (1, 1), (15, 31), (16, 32), (33, 95), (39, 64), (7, 17)]:
        panel, n = divmod(feature, 16)
        b, kk = divmod(k, 32)
        i, p = divmod(kk, 2)
        lane = 2 * n + p
        byte = int(packed.nib[panel, b, i, lane % 16])
        got = byte & 0x0F if lane < 16 else byte >> 4
        assert got == int(q[feature, k]), (feature, k)
        assert packed.dv[panel, b, lane] == d[feature, b]
        i_m, p_m = divmod(b, 2)  # block b's m sits at row b // 2, lane 2 n + b % 2
        assert packed.mv[panel, 0, i_m, 2 * n + p_m] == m[feature, b]
    # features 40..63 are padding: zero scales (panel 2's lanes 16.., all of panel 3)
    assert packed.dv[2, :, 16:].abs().sum() == 0 and packed.dv[3].abs().sum() == 0
    assert packed.dv[2, :, :16].abs().sum() > 0
    assert packed.mv[:, 0, nb // 2 + 1 :].abs().sum() == 0  # blocks past the last: zero


@needs_amx
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(32, 1), (64, 3), (576, 577), (1536, 100), (1024, 64)]
)
def test_amx_gemm_matches_the_reference_at_every_row_count(in_features, out_features):
    blocks = random_blocks("q4_1", out_features, in_features, seed=in_features + out_features)
    packed = ag.pack(blocks)
    gen = torch.Generator().manual_seed(out_features)
    xs = torch.randn(max(ROW_COUNTS), in_features, generator=gen)
    full = ag.amx_gemm(xs, packed)
    assert_matches_reference(xs, blocks, "q4_1", full)
    for rows in ROW_COUNTS:
        got = ag.amx_gemm(xs[:rows], packed)
        assert got.shape == (rows, out_features)
        assert torch.equal(got, full[:rows]), f"{rows} rows: a row changed with the row count"


@needs_amx
def test_amx_gemm_keeps_sixteen_bits_of_x_where_bf16_keeps_eight():
    """Inputs whose every mantissa bit matters, spread over 2^-20 .. 2^20: every output is
    within 2^-14 of |x||W| of the float64 product (each term's bound), the median 20x inside
    it; bf16 activations miss by more than 1e-4 of |x||W|. With inputs of one scale, as
    activations are, the terms' unbiased errors cancel: every output 10x inside the bound."""
    blocks = random_blocks("q4_1", 64, 576, seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, 576, generator=gen) * torch.exp2(torch.randint(-20, 21, (40, 576)).float())
    got = ag.amx_gemm(x, ag.pack(blocks))
    w = qv.dequantize(blocks, "q4_1")
    want = (x.double() @ w.double().t()).float()
    magnitude = x.abs() @ w.abs().t()
    err = (got - want).abs()
    assert (err <= 2.0**-14 * magnitude + 1e-30).all()
    assert (err / magnitude).median() <= 2.0**-14 / 20
    bf16 = x.bfloat16().float() @ w.t()
    assert ((bf16 - want).abs() > 1e-4 * magnitude).any()  # the error x's pieces avoid
    x = torch.randn(400, 576, generator=gen)
    err = (ag.amx_gemm(x, ag.pack(blocks)) - (x.double() @ w.double().t()).float()).abs()
    assert (err <= 2.0**-14 / 10 * (x.abs() @ w.abs().t())).all()


@needs_amx
def test_strided_rows_threads_and_out():
    blocks = random_blocks("q4_1", 96, 192, seed=2)
    packed = ag.pack(blocks)
    wide = torch.randn(70, 400)
    x = wide[:, 100:292]  # rows with a stride of 400
    out = torch.full((70, 96), float("nan"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ag.amx_gemm(x, packed, out=out) is out
        torch.set_num_threads(1)
        one = ag.amx_gemm(x.contiguous(), packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, one)
    with pytest.raises(ValueError, match="features"):
        ag.amx_gemm(torch.randn(40, 64), packed)
    with pytest.raises(ValueError, match="2-D float32"):
        ag.amx_gemm(x.double(), packed)


def test_a_build_without_amx_is_never_used():
    """The level without AMX builds everywhere and reports itself unable: available() is
    False, and the engine's linears keep the FMA GEMM."""
    ag.configure(AmxGemmOptions(isa="none"))
    try:
        lib = ag.load()
        if lib is None:
            pytest.skip("no C compiler")
        assert ag.library_isa(lib) == "none"
        assert lib.amx_ready() == 0 and not ag.available()
        with pytest.raises(RuntimeError, match="does not run here"):
            ag.amx_gemm(torch.randn(40, 32), ag.pack(random_blocks("q4_1", 4, 32)))
    finally:
        ag.configure(AmxGemmOptions())
    with pytest.raises(ValueError, match="not one of amx, none"):
        AmxGemmOptions(isa="avx2")


@needs_amx
def test_a_tile_product_that_traps_kills_only_the_probes_child(tmp_path):
    """amx_ready() runs its first tile product in a forked child: where it traps (SIGILL, here a
    build whose probe traps on purpose), the answer is 0 and this process goes on."""
    errors: list[str] = []
    flags = ("-O2", "-DBRIGADE_TRAP_IN_PROBE", *ag.LEVELS.compiler_flags["amx"])
    cc = ag._KERNEL.compiler()
    assert cc is not None
    lib = cbuild.build_library(ag.SOURCE, cc, flags, tmp_path, errors)
    assert lib is not None, errors
    ag._bind(lib)
    assert lib.amx_ready() == 0
