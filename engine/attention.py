"""AttentionMetadata (built by the engine core each step) and the paged-attention dispatch.

`prepare_attention` turns the metadata into a per-step plan once; every layer then calls
`paged_attend`: the Triton kernel on CUDA; on the CPU the compiled kernel
(kernels/cpu_attention.py) for every bf16 token and the pure-torch reference for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_attention
from kernels.paged_attention import (
    ReferencePlan,
    build_reference_plan,
    paged_attention,
    paged_attention_reference,
    token_layout,
)


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
    reference: ReferencePlan | None  # CPU path
    token_seq_idx: Tensor | None  # [T] int32, CUDA path
    token_ctx_len: Tensor | None  # [T] int32, CUDA path
    block_tables: Tensor
    slot_mapping: Tensor


def prepare_attention(
    attn: AttentionMetadata, device: torch.device, dtype: torch.dtype = torch.float32
) -> AttentionPlan:
    """dtype: the model's; in bf16 on the CPU every token goes to the compiled kernel when it
    builds (fp32 keeps torch's SDPA, the kernel transformers runs, for exact parity with it)."""
    block_tables = attn.block_tables.to(device, non_blocking=True)
    slots = attn.slot_mapping.to(device, torch.int64, non_blocking=True)
    if device.type == "cuda":
        seq_idx, ctx_len = token_layout(attn.query_lens_cpu, attn.seq_lens_cpu, device)
        return AttentionPlan(None, seq_idx, ctx_len, block_tables, slots)
    kernel = dtype == torch.bfloat16 and cpu_attention.available()
    ref = build_reference_plan(
        block_tables,
        attn.query_lens_cpu,
        attn.seq_lens_cpu,
        attn.block_size,
        kernel=kernel,
    )
    return AttentionPlan(ref, None, None, block_tables, slots)


def paged_attend(
    q: Tensor,  # [T, H, D]
    k: Tensor,  # [T, KVH, D]
    v: Tensor,  # [T, KVH, D]
    kv_cache: tuple[Tensor, Tensor],  # each [num_blocks, block_size, KVH, D]
    plan: AttentionPlan,
    scale: float,
) -> Tensor:
    """Write this step's K/V into their slots, then attend over each sequence's cache."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, plan.slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, plan.slot_mapping, v)
    if plan.reference is not None:
        return paged_attention_reference(q, k, v, k_cache, v_cache, plan.reference, scale)
    return paged_attention(
        q, k_cache, v_cache, plan.block_tables, plan.token_seq_idx, plan.token_ctx_len, scale
    )
