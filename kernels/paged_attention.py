"""Paged attention: queries of many sequences against K/V stored in fixed-size cache blocks.

Token t of a sequence attends to that sequence's first `ctx_len[t]` cached keys (causal: a query
at context position p sees keys 0..p). Three parts: the Triton kernel (GPU, or CPU under
TRITON_INTERPRET=1), its checked wrapper, and a slow pure-torch reference that every fast path
is tested against (the CPU engine runs kernels/cpu_sdpa_attention.py or kernels/cpu_attention.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


def token_layout(
    query_lens: list[int], seq_lens: list[int], device: torch.device
) -> tuple[Tensor, Tensor]:
    """Per-token sequence index [T] int32 and number of keys it attends [T] int32."""
    seq_idx: list[int] = []
    ctx_len: list[int] = []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        seq_idx += [i] * ql
        ctx_len += range(sl - ql + 1, sl + 1)
    return (
        torch.tensor(seq_idx, dtype=torch.int32, device=device),
        torch.tensor(ctx_len, dtype=torch.int32, device=device),
    )


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr,  # [T, H, D]
        q_ptr,  # [T, H, D]
        k_cache_ptr,  # [num_blocks, block_size, KVH, D]
        v_cache_ptr,
        block_tables_ptr,  # [S, max_blocks] int32
        token_seq_idx_ptr,  # [T] int32
        token_ctx_len_ptr,  # [T] int32
        scale,
        stride_ot,
        stride_oh,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        block_size,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,  # block_size rounded up to a power of two
    ):
        # One program per (token, kv head): the GROUP query heads sharing that KV head, with an
        # online softmax over the sequence's cache blocks (fp32 accumulation).
        tok = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(token_seq_idx_ptr + tok)
        ctx_len = tl.load(token_ctx_len_ptr + tok)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q = tl.load(
            q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [GROUP_PAD, HEAD_DIM_PAD]
        q = q * scale
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for start in range(0, ctx_len, block_size):
            block = tl.load(block_tables_ptr + seq * stride_bt + start // block_size).to(tl.int64)
            valid = (offs_n < block_size) & (start + offs_n < ctx_len)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(
                k_cache_ptr
                + block * stride_kb
                + offs_n[:, None] * stride_ks
                + kvh * stride_kh
                + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)  # [BLOCK_N, HEAD_DIM_PAD]
            v = tl.load(
                v_cache_ptr
                + block * stride_vb
                + offs_n[:, None] * stride_vs
                + kvh * stride_vh
                + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


def paged_attention(
    q: Tensor,  # [T, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: Tensor,
    block_tables: Tensor,  # [S, max_blocks] int32, padding -1
    token_seq_idx: Tensor,  # [T] int32
    token_ctx_len: Tensor,  # [T] int32, each >= 1
    scale: float,
) -> Tensor:
    """Launch the Triton kernel after checking shapes, strides, dtypes and devices."""
    if triton is None:
        raise RuntimeError("triton is not installed; on the CPU use kernels/cpu_sdpa_attention.py")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kd = k_cache.shape
    if v_cache.shape != k_cache.shape or kd != head_dim:
        raise ValueError(f"cache shapes K {tuple(k_cache.shape)} V {tuple(v_cache.shape)} vs q")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    tensors = (q, k_cache, v_cache, block_tables, token_seq_idx, token_ctx_len)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, strides {t.stride()}")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be a row-contiguous int32 tensor")
    if token_seq_idx.shape != (num_tokens,) or token_ctx_len.shape != (num_tokens,):
        raise ValueError(f"token_seq_idx/token_ctx_len must be [{num_tokens}]")
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        token_seq_idx,
        token_ctx_len,
        scale,
        out.stride(0),
        out.stride(1),
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        block_size,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_N=triton.next_power_of_2(block_size),
    )
    return out


def paged_attention_reference(
    q: Tensor,  # [T, H, D]
    k_cache: Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: Tensor,
    block_tables: Tensor,  # [S, max_blocks], padding -1
    token_seq_idx: Tensor,  # [T]
    token_ctx_len: Tensor,  # [T], each >= 1
    scale: float,
) -> Tensor:
    """The definition, slow and plain, for tests: token by token, the sequence's first ctx_len
    keys and values read from its blocks, softmax(q k^T * scale) v in float64, query head h
    reading KV head h // (H / KVH). Same arguments as `paged_attention`; returns q's dtype."""
    num_tokens, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for t in range(num_tokens):
        seq, ctx_len = int(token_seq_idx[t]), int(token_ctx_len[t])
        blocks = block_tables[seq, : -(-ctx_len // block_size)].long()  # [nb]
        k = k_cache[blocks].flatten(0, 1)[:ctx_len].double()  # [ctx_len, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx_len].double()
        k = k.repeat_interleave(group, dim=1)  # [ctx_len, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].double(), k) * scale  # [H, ctx_len]
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)  # [H, D]
    return out.to(q.dtype)
