"""The screened greedy head against the whole fp32 head's argmax, at each instruction-set level
and on AMX's int8 tiles where they run: the same token for every row, on rows whose int8 sums
put the wrong token first (near-duplicate vocabulary rows), exact ties (the first wins), a
vocabulary not a multiple of 16, outliers, and the cases it must hand back (values not finite,
too many candidates)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_amx_gemm as ag
from kernels import cpu_greedy_head as gh
from kernels import cpu_quant_gemv as qg
from kernels.cpu_argmax import argmax_rows
from kernels.cpu_greedy_head import HeadOptions, ScreenedHead
from tests.kernels.test_cpu_quant_gemv import random_blocks

pytestmark = pytest.mark.skipif(gh.load() is None, reason="no C compiler to build it")
HERE = qg.cpu_flags()
HIDDEN = 96  # 3 blocks of 32 (the AMX screen pads it to 128)
needs_amx = pytest.mark.skipif(
    not ag.available(), reason="AMX (tile, bf16, int8) does not run on this CPU, or no compiler"
)


def forced(level: str):
    if not gh.LEVELS.needs[level] <= HERE and qg.is_x86():
        pytest.skip(f"this CPU lacks {sorted(gh.LEVELS.needs[level] - HERE)}")
    gh.configure(HeadOptions(isa=level))
    lib = gh.load()
    assert lib is not None
    if qg.is_x86():
        assert gh.library_isa(lib) == level
    return lib


def full_argmax(h: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return argmax_rows(qg.quant_gemv(h, blocks, "q8_0"))


def near_duplicates(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """Q8_0 rows that are one base row with a code or two moved by one step: their logits differ
    by a few of x's values times d, far less than what rounding x to int8 moves them."""
    blocks = random_blocks("q8_0", vocab, hidden, seed=seed)
    base = blocks[0].clone()
    out = base.repeat(vocab, 1)
    gen = torch.Generator().manual_seed(seed)
    codes = out[:, :].view(vocab, hidden // 32, 34)[:, :, 2:].view(torch.int8)  # [V, nb, 32]
    for v in range(1, vocab):
        for _ in range(2):
            b, i = (
                int(torch.randint(hidden // 32, (1,), generator=gen)),
                int(torch.randint(32, (1,), generator=gen)),
            )
            step = 1 if int(torch.randint(2, (1,), generator=gen)) else -1
            codes[v, b, i] = max(-127, min(127, int(codes[v, b, i]) + step))
    return out.contiguous()


def activations(rows: int, hidden: int, seed: int) -> torch.Tensor:
    """Rows with a few outliers, as a final norm's output has."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen)
    h[:, ::17] *= 20.0
    return h


@pytest.mark.parametrize("level", gh.ISA_LEVELS)
def test_each_forced_level_gives_the_whole_heads_argmax(level):
    try:
        lib = forced(level)
        for vocab, seed in ((4096, 1), (1000 + 7, 2)):  # 1007: a last group of 15 lanes
            blocks = random_blocks("q8_0", vocab, HIDDEN, seed=seed)
            head = ScreenedHead(blocks, lib=lib)
            for rows in (1, 3, 4, 5, 17, 32):
                h = activations(rows, HIDDEN, seed=rows)
                got = head.argmax(h)
                assert got is not None and got.dtype == torch.int64
                assert torch.equal(got, full_argmax(h, blocks))
                found = head.candidates(h)
                assert all(int(c.max()) < vocab for c in found)  # never a pad lane
                assert all(torch.equal(c, c.sort().values) for c in found)
    finally:
        gh.configure(HeadOptions())


@pytest.mark.parametrize("level", gh.ISA_LEVELS)
def test_rows_whose_int8_sums_rank_them_wrong_are_decided_by_their_fp32_logits(level):
    """Near-duplicate rows: the screen keeps many of them, and the recompute picks the right
    one. Without the bound (the approximate argmax alone) most of these rows come out wrong."""
    try:
        lib = forced(level)
        blocks = near_duplicates(512, HIDDEN, seed=5)
        head = ScreenedHead(blocks, lib=lib)
        h = activations(32, HIDDEN, seed=9)
        want = full_argmax(h, blocks)
        assert torch.equal(head.argmax(h), want)
        found = head.candidates(h)
        assert min(len(c) for c in found) > 1  # the bound left more than the approximate best
        for c, w in zip(found, want.tolist(), strict=True):
            assert w in c.tolist()
    finally:
        gh.configure(HeadOptions())


def test_exact_ties_give_the_first_token_as_torch_does():
    blocks = random_blocks("q8_0", 600, HIDDEN, seed=4)
    blocks[[100, 300, 599]] = blocks[42].clone()  # four equal rows: 42 first
    w = qg.dequantize(blocks[42:43], "q8_0")
    h = w.repeat(8, 1) + 0.01 * activations(8, HIDDEN, seed=1)  # rows that point at row 42
    want = full_argmax(h, blocks)
    assert want.tolist() == [42] * 8
    assert torch.equal(ScreenedHead(blocks).argmax(h), want)
    blocks[:] = blocks[42].clone()  # every row equal: all 600 tie, and the first is token 0
    assert torch.equal(ScreenedHead(blocks).argmax(h), torch.zeros(8, dtype=torch.int64))


def test_values_not_finite_or_too_many_candidates_hand_back_to_the_whole_head():
    blocks = random_blocks("q8_0", 2000, HIDDEN, seed=6)
    head = ScreenedHead(blocks)
    h = activations(4, HIDDEN, seed=2)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = h.clone()
        x[2, 7] = bad
        assert head.argmax(x) is None
    assert head.argmax(torch.zeros(4, HIDDEN)) is None  # every logit 0: 2000 tie, > 1024
    small = h * 1e-28  # steps of ~1e-30: still exact
    assert torch.equal(head.argmax(small), full_argmax(small, blocks))
    tiny = h * 1e-34  # too small to divide by 127: every block is left out, nothing is decided
    assert head.argmax(tiny) is None


def test_it_refuses_scales_not_finite_and_inputs_of_another_shape():
    blocks = random_blocks("q8_0", 64, HIDDEN, seed=7)
    bad = blocks.clone()
    bad[5, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # fp16 +inf, little-endian
    with pytest.raises(ValueError, match="not finite"):
        ScreenedHead(bad)  # on the tiles where they run
    with pytest.raises(ValueError, match="not finite"):
        ScreenedHead(bad, amx=False)
    head = ScreenedHead(blocks)
    with pytest.raises(ValueError, match="rows"):
        head.argmax(torch.zeros(gh.MAX_ROWS + 1, HIDDEN))
    with pytest.raises(ValueError, match="float32"):
        head.argmax(torch.zeros(2, HIDDEN + 32))


def test_without_a_compiler_there_is_none(tmp_path):
    gh.configure(HeadOptions(compiler="false", cache_root=tmp_path))
    try:
        assert gh.load() is None and not gh.fast()
        with pytest.raises(RuntimeError, match="not available"):
            ScreenedHead(random_blocks("q8_0", 16, HIDDEN))
    finally:
        gh.configure(HeadOptions())
    assert gh.load() is not None


@needs_amx
@pytest.mark.parametrize("hidden", [64, HIDDEN, 576])
def test_the_amx_screen_gives_the_whole_heads_argmax_and_bounds_every_logit(hidden):
    """On the tiles: the same tokens as the whole head at 1 to 32 rows, every fp32 logit under
    its upper bound and the rows' greatest lower bound under their greatest logit; near
    duplicates are decided by their fp32 logits."""
    for vocab, seed in ((4096, 1), (1007, 2)):
        blocks = random_blocks("q8_0", vocab, hidden, seed=seed)
        head = ScreenedHead(blocks, amx=True)
        assert head.amx is not None
        for rows in (1, 3, 16, 17, 32):
            h = activations(rows, hidden, seed=rows)
            logits = qg.quant_gemv(h, blocks, "q8_0")
            assert torch.equal(head.argmax(h), argmax_rows(logits))
            assert bool((head.hi[:rows, :vocab] >= logits).all())
            assert bool((head.lo_max[:rows] <= logits.max(1).values).all())
    blocks = near_duplicates(512, hidden, seed=5)
    h = activations(32, hidden, seed=9)
    head = ScreenedHead(blocks, amx=True)
    assert torch.equal(head.argmax(h), full_argmax(h, blocks))
    assert min(len(c) for c in head.candidates(h)) > 1


@needs_amx
def test_the_amx_pack_puts_each_code_where_the_tiles_read_it_with_its_rows_terms():
    blocks = random_blocks("q8_0", 40, HIDDEN, seed=3)
    packed = ag.pack_screen(blocks)
    w = qg.dequantize(blocks, "q8_0").double()
    assert tuple(packed.wq.shape) == (4, 2, 16, 16, 4) and packed.padded_vocab == 64
    s, a, ew, norm = packed.wv[:, :40].double().unbind(0)
    assert torch.equal(s, (w.abs().amax(1) / 127).float().double())
    # wq[g, t, i, n, j] is the code of vocab row 16 g + n, input 64 t + 4 i + j
    q = packed.wq.permute(0, 3, 1, 2, 4).reshape(64, 128)  # back to [vocab, input]
    assert bool((q[40:] == 0).all()) and bool((q[:, HIDDEN:] == 0).all())  # the pads
    err = (w - s[:, None] * q[:40, :HIDDEN].double()).abs()
    assert bool((err.amax(1) <= ew).all()) and bool((ew <= s / 2 * 1.001).all())
    assert bool((w.abs().sum(1) <= a).all()) and bool((w.norm(dim=1) <= norm).all())
    assert int(q[16 + 7, 64 + 60 + 3]) == int(packed.wq[1, 1, 15, 7, 3])


def test_the_amx_screen_is_refused_where_the_tiles_do_not_run(monkeypatch):
    monkeypatch.setattr(ag, "available", lambda: False)
    with pytest.raises(RuntimeError, match="AMX screen"):
        ScreenedHead(random_blocks("q8_0", 64, HIDDEN, seed=1), amx=True)
    assert ScreenedHead(random_blocks("q8_0", 64, HIDDEN, seed=1)).amx is None
