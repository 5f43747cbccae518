"""The compiled CPU paged-attention kernel against fp32 attention over the same blocks."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import KernelOptions

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C compiler to build the CPU kernel"
)


def make_case(lens, num_heads, num_kv_heads, head_dim, block_size=16, seed=0, extra_rows=0):
    """A shuffled block pool holding each sequence's keys, NaN in every slot nobody owns."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    v_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(need)
    tables, used = [], 0
    for n, nb in zip(lens, need, strict=True):
        blocks = ids[used : used + nb]
        used += nb
        for j in range(n):  # only the slots the sequence owns hold numbers
            b, off = blocks[j // block_size], j % block_size
            k_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen).bfloat16()
            v_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen).bfloat16()
        tables.append(blocks + [-1] * (width - nb))
    rows = len(lens) + extra_rows
    # q as the model slices it: the first num_heads heads of a [T, H + KVH, D] tensor
    qk = torch.randn(rows, num_heads + num_kv_heads, head_dim, generator=gen).bfloat16()
    return qk[:, :num_heads], k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def expected(q, k_cache, v_cache, tables, lens, rows, scale):
    """fp32 softmax(q k^T * scale) v per decode, GQA as transformers repeats KV heads."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = []
    for i, (n, row) in enumerate(zip(lens, rows, strict=True)):
        blocks = tables[i, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float()  # [n, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:n].float()
        qg = q[row].float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        p = (torch.einsum("hgd,nhd->hgn", qg, k) * scale).softmax(-1)
        out.append(torch.einsum("hgn,nhd->hgd", p, v).reshape(num_heads, head_dim))
    return torch.stack(out)


def run(q, k_cache, v_cache, tables, lens, rows, scale, seq_idx=None, lib=None):
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    i32 = torch.int32
    seq_idx = list(range(len(lens))) if seq_idx is None else seq_idx
    cpu_attention.paged_attention_cpu(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(seq_idx, dtype=i32),
        torch.tensor(rows, dtype=i32),
        torch.tensor(lens, dtype=i32),
        scale,
        out,
        lib,
    )
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 2, 32), (2, 2, 16)],  # SmolLM2's shape (specialised) and generic ones
)
def test_matches_fp32_attention_over_shuffled_blocks(num_heads, num_kv_heads, head_dim):
    lens = [1, 15, 16, 17, 33, 100, 250]
    q, kc, vc, tables = make_case(lens, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    rows = list(range(len(lens)))
    out = run(q, kc, vc, tables, lens, rows, scale)
    want = expected(q, kc, vc, tables, lens, rows, scale)
    assert torch.isfinite(out.float()).all()  # NaN in unowned slots was never read
    torch.testing.assert_close(out.float(), want, atol=8e-3, rtol=1e-2)


def test_writes_only_the_decode_rows_and_follows_seq_idx():
    lens = [40, 7]
    q, kc, vc, tables = make_case(lens, 9, 3, 64, extra_rows=2)
    # row 3 decodes sequence 0, row 1 decodes sequence 1; rows 0 and 2 belong to others
    out = run(q, kc, vc, tables, [40, 7], [3, 1], 0.125, seq_idx=[0, 1])
    want = expected(q, kc, vc, tables, [40, 7], [3, 1], 0.125)
    torch.testing.assert_close(out[[3, 1]].float(), want, atol=8e-3, rtol=1e-2)
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch():
    lens = [300, 5, 77, 1024, 64]
    q, kc, vc, tables = make_case(lens, 9, 3, 64, seed=3)
    batch = run(q, kc, vc, tables, lens, list(range(5)), 0.125)
    for i in range(5):
        alone = run(q, kc, vc, tables, [lens[i]], [i], 0.125, seq_idx=[i])
        assert torch.equal(alone[i], batch[i])


def test_rejects_what_it_cannot_compute():
    q, kc, vc, tables = make_case([20], 9, 3, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        run(q.float(), kc, vc, tables, [20], [0], 0.125)
    q17, kc17, vc17, t17 = make_case([20], 17, 1, 16)  # 17 query heads per KV head
    with pytest.raises(ValueError, match="at most 16 query heads per KV head"):
        run(q17, kc17, vc17, t17, [20], [0], 0.25)


def test_without_a_compiler_load_returns_none(tmp_path, caplog):
    # nothing cached: it must build, with a "compiler" that always fails
    cpu_attention.configure(KernelOptions(compiler="false", cache_root=tmp_path))
    try:
        assert cpu_attention.load() is None
        assert "could not build the CPU paged-attention kernel" in caplog.text
        cpu_attention.configure(KernelOptions(enabled=False))  # BRIGADE_CPU_KERNEL=0
        assert not cpu_attention.available()
    finally:
        cpu_attention.configure(KernelOptions())
    assert cpu_attention.available()


def test_an_unwritable_cache_falls_back_instead_of_failing(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    cpu_attention.configure(KernelOptions(cache_root=blocker))  # the cache cannot be made
    try:
        assert cpu_attention.load() is None
        assert "could not build the CPU paged-attention kernel" in caplog.text
    finally:
        cpu_attention.configure(KernelOptions())
    assert cpu_attention.available()


def test_the_portable_build_gives_the_same_answers():
    """Without -march=native (no AVX512-BF16 path): the plain C loops, same results."""
    errors: list[str] = []
    lib = cpu_attention.build(cpu_attention.compiler(), cpu_attention.FLAG_SETS[1], errors)
    assert lib is not None, errors
    lens = [1, 17, 300]
    q, kc, vc, tables = make_case(lens, 9, 3, 64, seed=5)
    rows = [0, 1, 2]
    portable = run(q, kc, vc, tables, lens, rows, 0.125, lib=lib)
    native = run(q, kc, vc, tables, lens, rows, 0.125)
    want = expected(q, kc, vc, tables, lens, rows, 0.125)
    torch.testing.assert_close(portable.float(), want, atol=8e-3, rtol=1e-2)
    torch.testing.assert_close(portable.float(), native.float(), atol=8e-3, rtol=1e-2)
