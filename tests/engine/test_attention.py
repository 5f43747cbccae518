"""AttentionMetadata checks and the CPU dispatch: K/V land in their slots, output is causal."""

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attend, prepare_attention
from kernels import cpu_attention

BLOCK_SIZE = 4


def metadata(query_lens, seq_lens, tables, slots):
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=BLOCK_SIZE,
    )


def test_metadata_rejects_inconsistent_lengths():
    with pytest.raises(AssertionError, match="slot_mapping has 2"):
        metadata([3], [3], [[0]], [0, 1])
    with pytest.raises(AssertionError, match="needs more than 1 blocks"):
        metadata([1], [5], [[0]], [4])
    with pytest.raises(AssertionError, match=r"query len 4 must be in \[1, seq len 3\]"):
        metadata([4], [3], [[0]], [0, 1, 2, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attend_writes_slots_and_matches_dense_attention(dtype):
    """fp32 runs torch's SDPA; bf16 sends every token, the decode row and the prefill rows, to
    the compiled CPU kernel (when a compiler is found; else SDPA too)."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    k_cache = torch.zeros(6, BLOCK_SIZE, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # seq A: 5 tokens already cached in blocks 3, 1; one new token at position 5 (block 1)
    # seq B: a fresh 3-token prompt in block 4
    ctx_k, ctx_v = torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    ctx_k, ctx_v = ctx_k.to(dtype).float(), ctx_v.to(dtype).float()
    for p in range(5):
        block = [3, 1][p // BLOCK_SIZE]
        k_cache[block, p % BLOCK_SIZE], v_cache[block, p % BLOCK_SIZE] = ctx_k[p], ctx_v[p]
    q = torch.randn(4, heads, dim).to(dtype)
    k, v = torch.randn(4, kv_heads, dim).to(dtype), torch.randn(4, kv_heads, dim).to(dtype)
    slots = [1 * BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 0, 4 * BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 2]
    attn = metadata([1, 3], [6, 3], [[3, 1], [4, -1]], slots)
    plan = prepare_attention(attn, q.device, dtype)
    assert (plan.sdpa is None) == (dtype == torch.bfloat16 and cpu_attention.available())
    out = paged_attend(q, k, v, (k_cache, v_cache), plan, dim**-0.5).float()

    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[4, 2], v[3])
    assert torch.equal(k_cache[0], torch.zeros(BLOCK_SIZE, kv_heads, dim, dtype=dtype))
    q, k, v = q.float(), k.float(), v.float()

    def dense(qs, ks, vs):  # qs [ql, H, D] are the last ql positions of ks/vs [sl, KVH, D]
        ks, vs = ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * dim**-0.5
        ql, sl = qs.shape[0], ks.shape[0]
        causal = torch.arange(sl)[None, :] > torch.arange(sl - ql, sl)[:, None]
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, -torch.inf).softmax(-1), vs)

    expected_a = dense(q[:1], torch.cat([ctx_k, k[:1]]), torch.cat([ctx_v, v[:1]]))
    expected_b = dense(q[1:], k[1:], v[1:])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, torch.cat([expected_a, expected_b]), atol=tol, rtol=tol)


@pytest.mark.parametrize("cached", [0, 5], ids=["a whole prompt", "a chunk and a decode"])
def test_an_fp16_cache_under_fp32_stores_rounded_kv_and_every_token_attends_them(cached):
    """fp32 queries over an fp16 cache: this step's K and V are stored rounded, and attended
    rounded too (a whole prompt reads its own k, v, not the cache), so the output is fp32
    attention over the fp16 values, whichever step computed them."""
    torch.manual_seed(1)
    heads, kv_heads, dim, new = 4, 2, 8, 3
    k_cache = torch.zeros(6, BLOCK_SIZE, kv_heads, dim, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    ctx_k, ctx_v = torch.randn(2, cached, kv_heads, dim).half().float()
    table = [3, 1, 4]
    slot = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached + new)]
    for p in range(cached):
        k_cache.view(-1, kv_heads, dim)[slot[p]] = ctx_k[p].half()
        v_cache.view(-1, kv_heads, dim)[slot[p]] = ctx_v[p].half()
    q, k, v = (
        torch.randn(new, heads, dim),
        torch.randn(new, kv_heads, dim),
        torch.randn(new, kv_heads, dim),
    )
    attn = metadata([new], [cached + new], [table], slot[cached:])
    plan = prepare_attention(attn, q.device, torch.float32)
    assert plan.sdpa is not None
    out = paged_attend(q, k, v, (k_cache, v_cache), plan, dim**-0.5)

    assert out.dtype == torch.float32
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slot[cached:]], k.half()) and torch.equal(
        flat_v[slot[cached:]], v.half()
    )
    keys = torch.cat([ctx_k, k.half().float()]).repeat_interleave(2, 1)
    values = torch.cat([ctx_v, v.half().float()]).repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * dim**-0.5
    causal = torch.arange(cached + new)[None, :] > torch.arange(cached, cached + new)[:, None]
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, -torch.inf).softmax(-1), values)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    unrounded = torch.cat([ctx_k, k]).repeat_interleave(2, 1)  # what an fp32 cache would hold
    s2 = torch.einsum("qhd,khd->hqk", q, unrounded) * dim**-0.5
    assert not torch.allclose(s2, scores, atol=1e-6, rtol=0)  # so the rounding is seen


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the CPU kernel")
def test_bf16_plan_gives_every_token_its_own_causal_context():
    attn = metadata(
        [3, 1, 2], [3, 20, 7], [[3, -1, -1, -1, -1], [0, 1, 5, 6, 7], [2, 8, -1, -1, -1]], [0] * 6
    )
    plan = prepare_attention(attn, torch.device("cpu"), torch.bfloat16)
    assert plan.sdpa is None
    assert plan.token_seq_idx.tolist() == [0, 0, 0, 1, 2, 2]
    assert plan.token_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.token_ctx_len.tolist() == [1, 2, 3, 20, 6, 7]  # causal: up to its own position
    tables = plan.block_tables
    assert tables.dtype == torch.int32 and tables.is_contiguous()
    assert tables.tolist() == attn.block_tables.tolist()
