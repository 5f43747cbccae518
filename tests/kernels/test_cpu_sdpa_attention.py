"""The torch SDPA path over gathered blocks against the slow reference (GQA ratios, block sizes,
awkward lengths, dtypes, both gather paths), and the plan's grouping of decodes by length."""

import pytest
import torch

import kernels.cpu_sdpa_attention as sdpa
from tests.kernels.paged_cases import TOLERANCE, make_case, reference


def run_sdpa(case, query_lens, seq_lens, block_size, scale):
    qs, keys, values, k_cache, v_cache, block_tables = case
    plan = sdpa.build_sdpa_plan(block_tables, query_lens, seq_lens, block_size)
    q = torch.cat(qs)
    k_new = torch.cat([k[sl - ql :] for k, ql, sl in zip(keys, query_lens, seq_lens, strict=True)])
    v_new = torch.cat(
        [v[sl - ql :] for v, ql, sl in zip(values, query_lens, seq_lens, strict=True)]
    )
    return sdpa.paged_attention_sdpa(q, k_new, v_new, k_cache, v_cache, plan, scale)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "heads", "block_size"),
    [
        ([1, 1, 1], [1, 15, 17], (4, 4), 4),  # decodes; a 1-token fresh sequence
        ([15, 1, 17], [15, 33, 40], (6, 2), 8),  # fresh prefill, decode, chunk over context
        ([5], [5], (9, 3), 16),  # SmolLM2's 3:1 GQA, one partial block
        ([3, 1], [20, 1025], (8, 1), 16),  # multi-query, a long context
        ([1, 1, 1, 17], [1025, 17, 15, 17], (9, 3), 5),  # decodes in two groups, odd blocks
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode_path", ["small", "buffered"])
def test_sdpa_matches_the_reference(
    query_lens, seq_lens, heads, block_size, dtype, decode_path, monkeypatch
):
    if decode_path == "buffered":  # reused gather buffers (+ batched GEMMs for bf16/fp16)
        monkeypatch.setattr(sdpa, "SMALL_DECODE_KEYS", 0)
    num_heads, num_kv_heads = heads
    case = make_case(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
    )
    out = run_sdpa(case, query_lens, seq_lens, block_size, 16**-0.5)
    expected = reference(case, query_lens, seq_lens, 16**-0.5)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


def test_plan_batches_decodes_and_gathers_only_used_blocks():
    block_tables = torch.tensor([[7, 2, -1], [4, -1, -1], [5, 0, 1]], dtype=torch.int32)
    plan = sdpa.build_sdpa_plan(block_tables, [1, 3, 1], [20, 3, 33], block_size=16)
    (group,) = plan.decodes  # 2 and 3 blocks: similar enough to share one padded batch
    assert group.rows.tolist() == [4, 0]  # rows of seqs 2 and 0 in the step, longest first
    assert group.blocks.tolist() == [[5, 0, 1], [7, 2, 0]]  # padding -> block 0, masked
    assert group.mask.shape == (2, 1, 1, 48)
    assert group.mask[:, 0, 0].sum(-1).tolist() == [33, 20]
    (prefill,) = plan.prefills
    assert (prefill.start, prefill.end, prefill.blocks, prefill.mask) == (1, 4, None, None)


def test_plan_splits_decodes_of_very_different_lengths():
    lens = [300, 20, 260, 100, 1, 40]  # blocks of 16: 19, 2, 17, 7, -, 3
    tables = torch.arange(6 * 19, dtype=torch.int32).view(6, 19)
    plan = sdpa.build_sdpa_plan(tables, [1, 1, 1, 1, 1, 1], lens, block_size=16)
    assert [g.rows.tolist() for g in plan.decodes] == [[0, 2], [3], [5, 1]]
    assert [g.blocks.shape[1] for g in plan.decodes] == [19, 7, 3]
    assert [(p.start, p.end) for p in plan.prefills] == [(4, 5)]  # a 1-token fresh sequence
    q = torch.randn(6, 4, 8)
    k_cache = torch.randn(6 * 19, 16, 2, 8)
    v_cache = torch.randn(6 * 19, 16, 2, 8)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    out = sdpa.paged_attention_sdpa(q, k, v, k_cache, v_cache, plan, 8**-0.5)
    one_group = sdpa.build_sdpa_plan(tables, [1, 1, 1, 1, 1, 1], lens, block_size=16)
    mask = torch.arange(19 * 16)[None, :] < torch.tensor([300, 20, 260, 100, 40])[:, None]
    mask = mask[:, None, None]
    bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    rows = torch.tensor([0, 1, 2, 3, 5])
    one_group.decodes = [sdpa._DecodeGroup(rows, tables[rows].long(), mask, bias)]
    expected = sdpa.paged_attention_sdpa(q, k, v, k_cache, v_cache, one_group, 8**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("decode_path", ["small", "buffered"])
def test_fp32_queries_over_an_fp16_cache_are_fp32_attention_over_its_values(
    decode_path, monkeypatch
):
    """The gathers widen an fp16 cache to the queries' fp32: the same bits as an fp32 cache
    holding the same (fp16-representable) values, on both decode gathers and both prefills."""
    if decode_path == "buffered":
        monkeypatch.setattr(sdpa, "SMALL_DECODE_KEYS", 0)
    query_lens, seq_lens = [1, 1, 15, 17], [1025, 17, 15, 40]
    half = make_case(
        query_lens, seq_lens, num_heads=9, num_kv_heads=3, block_size=16, dtype=torch.float16
    )
    qs, keys, values, k_cache, v_cache, tables = half
    wide = ([q.float() for q in qs], [k.float() for k in keys], [v.float() for v in values])
    mixed = (*wide, k_cache, v_cache, tables)
    out = run_sdpa(mixed, query_lens, seq_lens, 16, 16**-0.5)
    want = run_sdpa((*wide, k_cache.float(), v_cache.float(), tables), query_lens, seq_lens, 16,
                    16**-0.5)  # fmt: skip
    assert out.dtype == torch.float32 and torch.equal(out, want)
