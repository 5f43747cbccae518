"""BlockManager: hands out fixed-size KV blocks, keeps each sequence's block table and ref counts.

Token position p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`, i.e. at slot `block_id * block_size + offset` of the flat KV pools. A block
returns to the free list when its last reference is dropped; free blocks are reused FIFO.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers the computed tokens plus `num_new_tokens` more."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow `seq.block_table` to hold `num_new_tokens` more tokens; returns the new block ids."""
        n = self.num_new_blocks(seq, num_new_tokens)
        assert n <= self.num_free_blocks, (
            f"allocate {n} blocks with {self.num_free_blocks} free: call can_allocate first"
        )
        new_ids = [self._free_block_ids.popleft() for _ in range(n)]
        for block_id in new_ids:
            assert self.ref_counts[block_id] == 0, f"free block {block_id} is still referenced"
            self.ref_counts[block_id] = 1
        seq.block_table.extend(new_ids)
        return new_ids

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share the parent's full computed blocks with a child (prefix sharing, no copy).

        Only full blocks are shared, so neither sequence ever writes into a shared block.
        Returns the number of tokens the child gets for free.
        """
        assert not child.block_table, "fork into a sequence that holds no blocks"
        num_full = parent.num_computed_tokens // self.block_size
        assert (
            parent.token_ids[: num_full * self.block_size]
            == child.token_ids[: num_full * self.block_size]
        ), "a child shares blocks only for tokens identical to the parent's"
        child.block_table = parent.block_table[:num_full]
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1
        child.num_computed_tokens = num_full * self.block_size
        return child.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody references go back to the free list."""
        for block_id in seq.block_table:
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than taken"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)
        seq.block_table = []

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat KV slots of token positions [start, end) of `seq`."""
        bs, table = self.block_size, seq.block_table
        assert end <= len(table) * bs, f"positions up to {end} but only {len(table)} blocks"
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
