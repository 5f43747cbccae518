"""AttentionMetadata (built by the engine core each step) and the paged-attention dispatch.

`prepare_attention` turns the metadata into a per-step plan once; every layer then calls
`paged_attend`: the Triton kernel on CUDA; on the CPU the compiled kernel
(kernels/cpu_attention.py) for every bf16 token and every token of the fp32 batch-invariant mode,
torch's SDPA over gathered blocks (kernels/cpu_sdpa_attention.py) for the rest, except fp32
chunks with nothing cached before them when the model asks for the compiled causal kernel
(kernels/cpu_causal_attention.py). Which path runs is engine policy, so it is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_attention
from kernels.cpu_sdpa_attention import SdpaPlan, build_sdpa_plan, paged_attention_sdpa
from kernels.paged_attention import paged_attention, token_layout


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # [num_tokens] int64: block_id * block_size + offset of each new K/V
    query_start_loc: Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: Tensor  # [num_seqs] int32: context length after this step (computed + new)
    block_tables: Tensor  # [num_seqs, max_num_blocks_per_seq] int32; padding entries are -1
    query_lens_cpu: list[int]  # host copies so the CPU path never syncs
    seq_lens_cpu: list[int]
    block_size: int

    def __post_init__(self) -> None:
        nq, ns = len(self.query_lens_cpu), len(self.seq_lens_cpu)
        assert nq == ns == self.block_tables.shape[0], (
            f"{nq} query lens, {ns} seq lens, {self.block_tables.shape[0]} block-table rows"
        )
        assert sum(self.query_lens_cpu) == self.slot_mapping.shape[0], (
            f"query lens sum to {sum(self.query_lens_cpu)}, slot_mapping has "
            f"{self.slot_mapping.shape[0]} entries"
        )
        for ql, sl in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True):
            assert 1 <= ql <= sl, f"query len {ql} must be in [1, seq len {sl}]"
            assert sl <= self.block_tables.shape[1] * self.block_size, (
                f"seq len {sl} needs more than {self.block_tables.shape[1]} blocks"
            )


@dataclass
class AttentionPlan:
    """One step's attention inputs, shared by every layer: `sdpa` set for torch's SDPA, else
    every token as one query (token_*) for the Triton kernel or the compiled CPU kernel."""

    block_tables: Tensor  # [S, max_blocks] int32
    slot_mapping: Tensor  # [T] int64
    sdpa: SdpaPlan | None = None  # CPU without the compiled kernel (fp32, or no compiler)
    token_seq_idx: Tensor | None = None  # [T] int32 each token's row of block_tables
    token_ctx_len: Tensor | None = None  # [T] int32 keys it attends: its position + 1
    token_rows: Tensor | None = None  # [T] int32 its row of q (0..T-1): the CPU kernel's


def prepare_attention(
    attn: AttentionMetadata,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    per_token: bool = False,
    causal_kernel: bool = False,
) -> AttentionPlan:
    """dtype: the model's; in bf16 on the CPU every token goes to the compiled kernel when it
    builds, prefill tokens included, each as one query over the cached keys up to its own
    position: a token's attention is then computed the same way whether it is decoded,
    prefilled whole, in chunks or again after a preemption, whatever shares the step; and
    reading the blocks in place it beats gathering them for SDPA (prefill 1.1-1.3x at 128-2048
    tokens). fp32 keeps torch's SDPA, the kernel transformers runs, for exact parity with it,
    unless `per_token` (the batch-invariant mode): SDPA's sums change with how a step batches
    and pads its sequences, the compiled kernel's do not. `causal_kernel`: fp32 chunks with
    nothing cached before them attend through the compiled causal kernel, not SDPA (the model
    on GGUF blocks, whose sums already differ from transformers' in order)."""
    block_tables = attn.block_tables.to(device, non_blocking=True)
    slots = attn.slot_mapping.to(device, torch.int64, non_blocking=True)
    if device.type == "cuda":
        seq_idx, ctx_len = token_layout(attn.query_lens_cpu, attn.seq_lens_cpu, device)
        return AttentionPlan(block_tables, slots, token_seq_idx=seq_idx, token_ctx_len=ctx_len)
    if (dtype == torch.bfloat16 or per_token) and cpu_attention.available():
        seq_idx, ctx_len = token_layout(attn.query_lens_cpu, attn.seq_lens_cpu, device)
        return AttentionPlan(
            block_tables.to(torch.int32).contiguous(),
            slots,
            token_seq_idx=seq_idx,
            token_ctx_len=ctx_len,
            token_rows=torch.arange(len(seq_idx), dtype=torch.int32),
        )
    sdpa = build_sdpa_plan(
        block_tables, attn.query_lens_cpu, attn.seq_lens_cpu, attn.block_size, causal_kernel
    )
    return AttentionPlan(block_tables, slots, sdpa=sdpa)


def paged_attend(
    q: Tensor,  # [T, H, D]
    k: Tensor,  # [T, KVH, D]
    v: Tensor,  # [T, KVH, D]
    kv_cache: tuple[Tensor, Tensor],  # each [num_blocks, block_size, KVH, D]
    plan: AttentionPlan,
    scale: float,
) -> Tensor:
    """Write this step's K/V into their slots, then attend over each sequence's cache.

    A cache of a narrower dtype than the model's (fp16 under fp32) stores K and V rounded, and
    this step attends its own K and V rounded the same way: a token's keys read the same whether
    they were computed in this step or an earlier one."""
    k_cache, v_cache = kv_cache
    if k_cache.dtype != k.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, plan.slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, plan.slot_mapping, v)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if plan.sdpa is not None:
        return paged_attention_sdpa(q, k, v, k_cache, v_cache, plan.sdpa, scale)
    if plan.token_rows is not None:
        out = q.new_empty(q.shape)
        cpu_attention.paged_attention_cpu(
            q,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.token_seq_idx,
            plan.token_rows,
            plan.token_ctx_len,
            scale,
            out,
        )
        return out
    return paged_attention(
        q, k_cache, v_cache, plan.block_tables, plan.token_seq_idx, plan.token_ctx_len, scale
    )
