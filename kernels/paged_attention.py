"""Paged attention: queries of many sequences against K/V stored in fixed-size cache blocks.

Token t of a sequence attends to that sequence's first `ctx_len[t]` cached keys (causal: a query
at context position p sees keys 0..p). Three parts: the Triton kernel (GPU, or CPU under
TRITON_INTERPRET=1), its checked wrapper, and the pure-torch reference the CPU engine runs in
fp32 (bf16 hands the plan's tokens to the compiled kernel in kernels/cpu_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.cpu_attention import paged_attention_cpu

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
        raise RuntimeError("triton is not installed; use paged_attention_reference on this host")
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


@dataclass
class _PrefillSeq:
    start: int  # rows [start, end) of the step's tokens
    end: int
    blocks: Tensor | None  # [num_blocks] int64; None when the step holds the whole sequence
    mask: Tensor | None  # [q_len, ctx_len] bool, True = attend
    workspace: tuple[Tensor, Tensor] | None = None  # K, V gather buffers shared by all layers


@dataclass
class _DecodeGroup:
    rows: Tensor | None  # [n] int64 rows of the step's tokens; None: every row, in order
    blocks: Tensor  # [n, nb] int64 block ids (padding -> block 0, masked out)
    mask: Tensor  # [n, 1, 1, nb * block_size] bool, True = attend
    bias: Tensor  # [n, 1, 1, nb * block_size] float32: 0 where attended, -inf elsewhere
    # gather buffers (staging, K, V), made by the first layer and reused by the others: fresh
    # multi-MB allocations page-fault on every layer and cost more than the copy itself
    workspace: tuple[Tensor, Tensor, Tensor] | None = None


@dataclass
class _KernelTokens:
    """Every token of the step as one query for the compiled CPU kernel (all int32)."""

    block_tables: Tensor  # [S, W] the step's block tables
    seq_idx: Tensor  # [T] each token's row of block_tables
    rows: Tensor  # [T] each token's row of the step's tokens
    seq_lens: Tensor  # [T] keys each token attends: its position + 1


@dataclass
class ReferencePlan:
    """What the reference needs per step, built once and shared by every layer."""

    decodes: list[_DecodeGroup]  # single-token sequences, batched by similar length
    prefills: list[_PrefillSeq]  # the others, one by one
    kernel: _KernelTokens | None = None  # set: every token goes to the compiled CPU kernel


MAX_DECODE_GROUPS = 4


def build_reference_plan(
    block_tables: Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    *,
    kernel: bool = False,
) -> ReferencePlan:
    """kernel: hand every token to kernels.cpu_attention (bf16, CPU), prefill tokens included,
    each as one query over the cached keys up to its own position. A token's attention is then
    computed the same way whether it is decoded, prefilled whole, prefilled in chunks or
    recomputed after a preemption, whatever shares the step; and reading the blocks in place it
    beats gathering them for torch's SDPA (prefill 1.1-1.3x at 128-2048 tokens here).
    """
    if kernel:
        seq_idx, rows, lens, row = [], [], [], 0
        for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
            seq_idx += [i] * ql
            rows += range(row, row + ql)
            lens += range(sl - ql + 1, sl + 1)
            row += ql
        return ReferencePlan(
            [],
            [],
            _KernelTokens(
                block_tables.to(torch.int32).contiguous(),
                torch.tensor(seq_idx, dtype=torch.int32),
                torch.tensor(rows, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32),
            ),
        )
    device = block_tables.device
    tables = block_tables.to(torch.int64).clamp_min(0)  # [S, max_blocks]
    decodes, prefills, row = [], [], 0  # decodes: (row, seq index, num blocks)
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if ql == 1 and sl > 1:
            decodes.append((row, i, -(-sl // block_size)))
        elif ql == sl:  # nothing cached before this step: plain causal attention
            prefills.append(_PrefillSeq(row, row + ql, None, None))
        else:
            pos = torch.arange(sl, device=device)
            mask = pos[None, :] <= pos[sl - ql :, None]  # [ql, sl]
            prefills.append(_PrefillSeq(row, row + ql, tables[i, : -(-sl // block_size)], mask))
        row += ql
    groups = _group_by_length(decodes)
    every_row = len(groups) == 1 and len(decodes) == row
    if every_row:
        groups = [decodes]  # keep step order so the output needs no scatter
    plans = []
    for group in groups:
        nb = max(n for _, _, n in group)
        seqs = [i for _, i, _ in group]
        lens = torch.tensor([seq_lens[i] for i in seqs], device=device)
        mask = torch.arange(nb * block_size, device=device)[None, :] < lens[:, None]
        rows = None if every_row else torch.tensor([r for r, _, _ in group], device=device)
        mask = mask[:, None, None, :]
        bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        plans.append(_DecodeGroup(rows, tables[seqs, :nb], mask, bias))
    return ReferencePlan(plans, prefills)


def _group_by_length(decodes: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split decodes (longest first) where the block count halves, so a short context is not
    padded to the longest one; at most MAX_DECODE_GROUPS groups (each costs a few ops)."""
    groups: list[list[tuple[int, int, int]]] = []
    for d in sorted(decodes, key=lambda d: -d[2]):
        if not groups or (2 * d[2] <= groups[-1][0][2] and len(groups) < MAX_DECODE_GROUPS):
            groups.append([d])
        else:
            groups[-1].append(d)
    return groups


SMALL_DECODE_KEYS = 4096  # below this many gathered keys per group: plain gather + SDPA


def _gather_kv(g: _DecodeGroup, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The group's blocks as K and V [n, KVH, L, D] (L = nb * block_size).

    Small groups: fresh tensors, viewed head-major. Large ones: contiguous copies into buffers
    made by the first layer and reused by the rest (fresh multi-MB allocations page-fault).
    """
    n, nb = g.blocks.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = g.blocks.flatten()
    token_major = (n, nb * block_size, num_kv_heads, head_dim)
    if n * nb * block_size < SMALL_DECODE_KEYS:
        return tuple(
            c.index_select(0, flat).view(token_major).transpose(1, 2) for c in (k_cache, v_cache)
        )
    if g.workspace is None:
        staging = k_cache.new_empty(n * nb, block_size, num_kv_heads, head_dim)
        shape = (n, num_kv_heads, nb * block_size, head_dim)
        g.workspace = (staging, k_cache.new_empty(shape), k_cache.new_empty(shape))
    staging, k_out, v_out = g.workspace
    for cache, out in ((k_cache, k_out), (v_cache, v_out)):
        torch.index_select(cache, 0, flat, out=staging)
        out.copy_(staging.view(token_major).transpose(1, 2))
    return k_out, v_out


def paged_attention_reference(
    q: Tensor,  # [T, H, D]
    k: Tensor,  # [T, KVH, D] this step's keys (already written to the cache)
    v: Tensor,
    k_cache: Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: Tensor,
    plan: ReferencePlan,
    scale: float,
) -> Tensor:
    """Every token through the compiled CPU kernel when the plan says so; else decodes gathered
    and batched, prefills one by one, gathering only the blocks each uses."""
    if plan.kernel is not None:
        kt = plan.kernel
        out = q.new_empty(q.shape)
        paged_attention_cpu(
            q, k_cache, v_cache, kt.block_tables, kt.seq_idx, kt.rows, kt.seq_lens, scale, out
        )
        return out
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    out = None
    for g in plan.decodes:
        qd = q if g.rows is None else q[g.rows]
        nd = g.blocks.shape[0]
        kd, vd = _gather_kv(g, k_cache, v_cache)  # [nd, KVH, L, D] each
        qd = qd.view(nd, num_kv_heads, group_size, head_dim)  # a KV head's queries share its keys
        if q.dtype == torch.float32 or g.workspace is None:
            # fp32: the same kernel transformers uses (exactness); small groups: one op is cheapest
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        else:  # skinny batched GEMMs beat the flash kernel ~3x for one query row per sequence
            scores = torch.matmul(qd, kd.transpose(-1, -2))  # [nd, KVH, G, L]
            probs = (scores.float() * scale + g.bias).softmax(-1).to(q.dtype)
            od = torch.matmul(probs, vd)  # [nd, KVH, G, D]
        od = od.reshape(nd, num_heads, head_dim)
        if g.rows is None:
            return od
        if out is None:
            out = torch.empty_like(q)
        out[g.rows] = od
    if out is None:
        out = torch.empty_like(q)
    for p in plan.prefills:
        qp = q[p.start : p.end].transpose(0, 1)  # [H, ql, D]
        if p.blocks is None:
            kp, vp = k[p.start : p.end].transpose(0, 1), v[p.start : p.end].transpose(0, 1)
        else:
            if p.workspace is None:
                shape = (p.blocks.shape[0], *k_cache.shape[1:])
                p.workspace = (k_cache.new_empty(shape), v_cache.new_empty(shape))
            ctx_len = p.mask.shape[1]
            kp, vp = (
                torch.index_select(cache, 0, p.blocks, out=buf)
                .flatten(0, 1)[:ctx_len]
                .transpose(0, 1)
                for cache, buf in zip((k_cache, v_cache), p.workspace, strict=True)
            )  # [KVH, ctx_len, D] each
        # 4-D inputs (a batch of one) take torch's fused CPU kernel; 3-D ones fall back to the
        # unfused math path, ~2.7x slower for a 512-token chunk over a 2048-token context
        mask = None if p.mask is None else p.mask[None, None]  # [1, 1, ql, ctx_len]
        op = F.scaled_dot_product_attention(
            qp[None],
            kp[None],
            vp[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, ql, D]
        out[p.start : p.end] = op[0].transpose(0, 1)
    return out
