"""Paged attention on the CPU in torch: each step's cache blocks gathered for torch's SDPA.

A plan, built once per step and shared by every layer, batches the decodes by similar context
length (padding a short context to a long one costs its keys) and takes each prefill chunk on
its own, gathering only the blocks it uses. fp32 runs torch's SDPA, the kernel transformers
runs, so the dense fp32 path's logits match it exactly; a plan with `causal_kernel` (the model
on GGUF blocks) sends chunks with nothing cached before them to the compiled causal kernel
instead (kernels/cpu_causal_attention.py, fp32 sums in another order). Checked against the slow
reference in kernels/paged_attention.py (tests/kernels/test_cpu_sdpa_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_causal_attention


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
class SdpaPlan:
    """What `paged_attention_sdpa` needs per step, built once and shared by every layer."""

    decodes: list[_DecodeGroup]  # single-token sequences, batched by similar length
    prefills: list[_PrefillSeq]  # the others, one by one
    # fp32 chunks with nothing cached before them through the compiled causal kernel
    # (kernels/cpu_causal_attention.py) instead of SDPA
    causal_kernel: bool = False


MAX_DECODE_GROUPS = 4


def build_sdpa_plan(
    block_tables: Tensor,  # [S, max_blocks] int32, padding -1
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    causal_kernel: bool = False,
) -> SdpaPlan:
    """Decodes (one new token over a cached context) in at most MAX_DECODE_GROUPS padded
    batches, longest first; every other sequence (a prompt or a chunk of one) on its own."""
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
    return SdpaPlan(plans, prefills, causal_kernel)


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


def _gather_kv(
    g: _DecodeGroup, k_cache: Tensor, v_cache: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The group's blocks as K and V [n, KVH, L, D] (L = nb * block_size) in `dtype`, the
    queries' (a 16-bit cache under an fp32 model is widened here).

    Small groups: fresh tensors, viewed head-major. Large ones: contiguous copies into buffers
    made by the first layer and reused by the rest (fresh multi-MB allocations page-fault).
    """
    n, nb = g.blocks.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = g.blocks.flatten()
    token_major = (n, nb * block_size, num_kv_heads, head_dim)
    if n * nb * block_size < SMALL_DECODE_KEYS:
        return tuple(
            c.index_select(0, flat).view(token_major).transpose(1, 2).to(dtype)
            for c in (k_cache, v_cache)
        )
    if g.workspace is None:
        staging = k_cache.new_empty(n * nb, block_size, num_kv_heads, head_dim)
        shape = (n, num_kv_heads, nb * block_size, head_dim)
        outs = (torch.empty(shape, dtype=dtype, device=k_cache.device) for _ in "kv")
        g.workspace = (staging, *outs)
    staging, k_out, v_out = g.workspace
    for cache, out in ((k_cache, k_out), (v_cache, v_out)):
        torch.index_select(cache, 0, flat, out=staging)
        out.copy_(staging.view(token_major).transpose(1, 2))
    return k_out, v_out


def paged_attention_sdpa(
    q: Tensor,  # [T, H, D]
    k: Tensor,  # [T, KVH, D] this step's keys (already written to the cache)
    v: Tensor,
    k_cache: Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: Tensor,
    plan: SdpaPlan,
    scale: float,
) -> Tensor:
    """Decodes gathered and batched, prefills one by one, gathering only the blocks each uses
    (a chunk with nothing cached before it attends its own k, v directly)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    out = None
    for g in plan.decodes:
        qd = q if g.rows is None else q[g.rows]
        nd = g.blocks.shape[0]
        kd, vd = _gather_kv(g, k_cache, v_cache, q.dtype)  # [nd, KVH, L, D] each
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
        if p.blocks is None and plan.causal_kernel and q.dtype == torch.float32:
            rows = slice(p.start, p.end)
            o = out[rows]
            if o.is_contiguous():  # (the kernel writes the rows in place)
                cpu_causal_attention.causal_attention(q[rows], k[rows], v[rows], scale, out=o)
            else:
                o.copy_(cpu_causal_attention.causal_attention(q[rows], k[rows], v[rows], scale))
            continue
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
                .to(q.dtype)
                for cache, buf in zip((k_cache, v_cache), p.workspace, strict=True)
            )  # [KVH, ctx_len, D] each, in q's dtype
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
