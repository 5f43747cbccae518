"""Paged attention: the torch reference against dense causal attention, the Triton kernel
(under TRITON_INTERPRET=1, tiny shapes) against the reference, per-dtype tolerances."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.paged_attention as pa
from kernels import cpu_attention

TOLERANCE = {  # STYLE.md's table
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}


def make_case(query_lens, seq_lens, *, num_heads, num_kv_heads, block_size, dtype, seed=0):
    """Random K/V for every context token, scattered into shuffled cache blocks."""
    g = torch.Generator().manual_seed(seed)
    head_dim = 16
    blocks_needed = [-(-sl // block_size) for sl in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    width = max(blocks_needed)
    tables, keys, values, qs = [], [], [], []
    for ql, sl, nb in zip(query_lens, seq_lens, blocks_needed, strict=True):
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks + [-1] * (width - nb))
        k = torch.randn(sl, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(sl, num_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(sl):
            k_cache[blocks[p // block_size], p % block_size] = k[p]
            v_cache[blocks[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
        qs.append(torch.randn(ql, num_heads, head_dim, generator=g).to(dtype))
    block_tables = torch.tensor(tables, dtype=torch.int32)
    return qs, keys, values, k_cache, v_cache, block_tables


def dense_causal(q, k, v):
    """Naive attention for one sequence: q [ql, H, D] are the last ql of k/v [sl, KVH, D]."""
    ql, num_heads, head_dim = q.shape
    sl, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    k = k.float().repeat_interleave(rep, dim=1)  # [sl, H, D]
    v = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(head_dim)
    q_pos = torch.arange(sl - ql, sl)[:, None]
    scores = scores.masked_fill(torch.arange(sl)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_reference(qs, keys, values, k_cache, v_cache, block_tables, query_lens, seq_lens, bs):
    plan = pa.build_reference_plan(block_tables, query_lens, seq_lens, bs)
    q = torch.cat(qs)
    k_new = torch.cat([k[sl - ql :] for k, ql, sl in zip(keys, query_lens, seq_lens, strict=True)])
    v_new = torch.cat(
        [v[sl - ql :] for v, ql, sl in zip(values, query_lens, seq_lens, strict=True)]
    )
    scale = q.shape[-1] ** -0.5
    return pa.paged_attention_reference(q, k_new, v_new, k_cache, v_cache, plan, scale)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "heads", "block_size"),
    [
        ([1, 1, 1], [1, 15, 17], (4, 4), 4),  # decodes; a 1-token fresh sequence
        ([15, 1, 17], [15, 33, 40], (6, 2), 8),  # fresh prefill, decode, chunk over context
        ([5], [5], (9, 3), 16),  # SmolLM2's 3:1 GQA, one partial block
        ([3, 1], [20, 1025], (8, 1), 16),  # multi-query, a long context
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_path", ["small", "buffered"])
def test_reference_matches_dense_causal_attention(
    query_lens, seq_lens, heads, block_size, dtype, decode_path, monkeypatch
):
    if decode_path == "buffered":  # reused gather buffers (+ batched GEMMs for bf16)
        monkeypatch.setattr(pa, "SMALL_DECODE_KEYS", 0)
    num_heads, num_kv_heads = heads
    case = make_case(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
    )
    qs, keys, values = case[:3]
    out = run_reference(*case, query_lens, seq_lens, block_size)
    expected = torch.cat([dense_causal(q, k, v) for q, k, v in zip(qs, keys, values, strict=True)])
    assert out.shape == expected.shape and out.dtype == dtype
    tol = TOLERANCE[dtype] if dtype != torch.float32 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.float(), expected, **tol)


def test_reference_plan_batches_decodes_and_gathers_only_used_blocks():
    block_tables = torch.tensor([[7, 2, -1], [4, -1, -1], [5, 0, 1]], dtype=torch.int32)
    plan = pa.build_reference_plan(block_tables, [1, 3, 1], [20, 3, 33], block_size=16)
    (group,) = plan.decodes  # 2 and 3 blocks: similar enough to share one padded batch
    assert group.rows.tolist() == [4, 0]  # rows of seqs 2 and 0 in the step, longest first
    assert group.blocks.tolist() == [[5, 0, 1], [7, 2, 0]]  # padding -> block 0, masked
    assert group.mask.shape == (2, 1, 1, 48)
    assert group.mask[:, 0, 0].sum(-1).tolist() == [33, 20]
    (prefill,) = plan.prefills
    assert (prefill.start, prefill.end, prefill.blocks, prefill.mask) == (1, 4, None, None)


def test_reference_plan_splits_decodes_of_very_different_lengths():
    lens = [300, 20, 260, 100, 1, 40]  # blocks of 16: 19, 2, 17, 7, -, 3
    tables = torch.arange(6 * 19, dtype=torch.int32).view(6, 19)
    plan = pa.build_reference_plan(tables, [1, 1, 1, 1, 1, 1], lens, block_size=16)
    assert [g.rows.tolist() for g in plan.decodes] == [[0, 2], [3], [5, 1]]
    assert [g.blocks.shape[1] for g in plan.decodes] == [19, 7, 3]
    assert [(p.start, p.end) for p in plan.prefills] == [(4, 5)]  # a 1-token fresh sequence
    q = torch.randn(6, 4, 8)
    k_cache = torch.randn(6 * 19, 16, 2, 8)
    v_cache = torch.randn(6 * 19, 16, 2, 8)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    out = pa.paged_attention_reference(q, k, v, k_cache, v_cache, plan, 8**-0.5)
    one_group = pa.build_reference_plan(tables, [1, 1, 1, 1, 1, 1], lens, block_size=16)
    mask = torch.arange(19 * 16)[None, :] < torch.tensor([300, 20, 260, 100, 40])[:, None]
    mask = mask[:, None, None]
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    rows = torch.tensor([0, 1, 2, 3, 5])
    one_group.decodes = [pa._DecodeGroup(rows, tables[rows].long(), mask, bias)]
    expected = pa.paged_attention_reference(q, k, v, k_cache, v_cache, one_group, 8**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_every_token_plan_gives_each_token_its_own_context():
    tables = torch.tensor([[3, -1], [0, 1], [2, -1]], dtype=torch.int32)
    plan = pa.build_reference_plan(tables, [3, 1, 2], [3, 20, 7], 16, kernel=True)
    assert (plan.decodes, plan.prefills) == ([], [])
    kd = plan.kernel
    assert kd.seq_idx.tolist() == [0, 0, 0, 1, 2, 2]
    assert kd.rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert kd.seq_lens.tolist() == [1, 2, 3, 20, 6, 7]  # causal: up to its own position
    assert kd.block_tables.dtype == torch.int32 and kd.block_tables.tolist() == tables.tolist()


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the CPU kernel")
def test_every_token_plan_is_causal_attention_and_chunking_changes_no_bit():
    lens, bs = [23, 9], 4
    case = make_case(lens, lens, num_heads=6, num_kv_heads=2, block_size=bs, dtype=torch.bfloat16)
    qs, keys, values, k_cache, v_cache, tables = case
    scale = 16**-0.5

    def attend(seqs):  # [(sequence, first new token, new tokens)] of one step
        q = torch.cat([qs[i][s : s + n] for i, s, n in seqs])
        plan = pa.build_reference_plan(
            tables[[i for i, _, _ in seqs]],
            [n for _, _, n in seqs],
            [s + n for _, s, n in seqs],
            bs,
            kernel=True,
        )
        kv = q.new_empty(len(q), 2, 16)  # already in the cache: make_case wrote every token
        return pa.paged_attention_reference(q, kv, kv, k_cache, v_cache, plan, scale)

    whole = attend([(0, 0, 23), (1, 0, 9)])
    expected = torch.cat([dense_causal(q, k, v) for q, k, v in zip(qs, keys, values, strict=True)])
    torch.testing.assert_close(whole.float(), expected, **TOLERANCE[torch.bfloat16])
    chunks = [attend([(0, 0, 10)]), attend([(1, 0, 4), (0, 10, 12)]), attend([(0, 22, 1)])]
    assert torch.equal(torch.cat([chunks[0], chunks[1][4:], chunks[2]]), whole[:23])
    assert torch.equal(torch.cat([chunks[1][:4], attend([(1, 4, 5)])]), whole[23:])


KERNEL_CASES = [  # (query_lens, seq_lens, (heads, kv heads), block_size, dtype)
    ([1, 1], [15, 17], (4, 2), 8, torch.float32),  # decode across a block boundary
    ([2, 1], [2, 1], (3, 3), 4, torch.float32),  # fresh prefill; a sequence of length 1
    ([3, 1], [17, 9], (9, 3), 16, torch.bfloat16),  # chunk on a cached prefix, GQA 3:1
    ([1], [12], (4, 1), 6, torch.float16),  # block size not a power of two
]


def check_kernel_cases() -> None:
    """Run in a child with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    for query_lens, seq_lens, (num_heads, num_kv_heads), block_size, dtype in KERNEL_CASES:
        case = make_case(
            query_lens,
            seq_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            dtype=dtype,
            seed=1,
        )
        qs, _, _, k_cache, v_cache, block_tables = case
        seq_idx, ctx_len = pa.token_layout(query_lens, seq_lens, torch.device("cpu"))
        q = torch.cat(qs)
        out = pa.paged_attention(q, k_cache, v_cache, block_tables, seq_idx, ctx_len, 0.25)
        expected = run_reference(*case, query_lens, seq_lens, block_size)
        assert out.dtype == dtype, (out.dtype, dtype)
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
        print("ok", query_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype)
    k_cache = torch.zeros(4, 8, 2, 16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    seq_idx, ctx_len = pa.token_layout([1], [5], torch.device("cpu"))
    bad = [
        ("dtype mismatch", torch.zeros(1, 4, 16, dtype=torch.bfloat16), tables),
        ("not a multiple", torch.zeros(1, 3, 16), tables),
        ("int32", torch.zeros(1, 4, 16), tables.long()),
    ]
    for message, q, t in bad:
        try:
            pa.paged_attention(q, k_cache, k_cache, t, seq_idx, ctx_len, 0.25)
        except ValueError as e:
            assert message in str(e), (message, str(e))
        else:
            raise AssertionError(f"no ValueError for {message}")
    print("ok wrapper checks")


def test_triton_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    root = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    code = "from tests.kernels.test_paged_attention import check_kernel_cases as c; c()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == len(KERNEL_CASES) + 1
