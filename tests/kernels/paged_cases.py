"""Shared paged-attention test cases: random K/V in shuffled cache blocks, the slow reference on
them, and STYLE.md's per-dtype tolerance table."""

from __future__ import annotations

import torch

import kernels.paged_attention as pa

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}


def make_case(query_lens, seq_lens, *, num_heads, num_kv_heads, block_size, dtype, seed=0):
    """Random K/V for every context token, scattered into shuffled cache blocks.

    -> (qs, keys, values, k_cache, v_cache, block_tables): per sequence its queries [ql, H, D]
    (its last ql positions) and its keys and values [sl, KVH, D]; the caches hold every key."""
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


def reference(case, query_lens, seq_lens, scale):
    """The slow reference on a make_case case: [sum(query_lens), H, D] in the case's dtype."""
    qs, _, _, k_cache, v_cache, block_tables = case
    seq_idx, ctx_len = pa.token_layout(query_lens, seq_lens, torch.device("cpu"))
    q = torch.cat(qs)
    return pa.paged_attention_reference(q, k_cache, v_cache, block_tables, seq_idx, ctx_len, scale)
