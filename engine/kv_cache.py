"""The paged KV cache: per-layer K and V pools of fixed-size blocks, sized from a memory budget.

KV bytes = 2 (K and V) x layers x batch x kv_heads x tokens x head_dim x bytes per element;
GQA models store only their `num_kv_heads`, not their query heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import ModelConfig

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~46k tokens of SmolLM2-135M in bf16, ~23k in fp32


def estimate_kv_bytes(
    config: ModelConfig, *, num_tokens: int, batch_size: int = 1, dtype: torch.dtype
) -> int:
    """Bytes of K and V for `batch_size` sequences of `num_tokens` tokens each."""
    return (
        2
        * config.num_layers
        * batch_size
        * config.num_kv_heads
        * num_tokens
        * config.head_dim
        * dtype.itemsize
    )


def num_blocks_for_budget(
    config: ModelConfig, *, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes`; at least 1 is an error."""
    per_block = estimate_kv_bytes(config, num_tokens=block_size, dtype=dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={budget_bytes} holds no block of {block_size} tokens "
            f"({per_block} bytes each); raise kv_cache_memory_bytes or lower block_size"
        )
    return num_blocks


class KVCache:
    """Per-layer (K, V) pools, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeroed, not empty: padding slots are masked, but 0 * NaN garbage would still be NaN.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
