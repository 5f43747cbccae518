"""BlockManager: hands out fixed-size KV blocks, keeps each sequence's block table and ref counts.

Token position p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`, i.e. at slot `block_id * block_size + offset` of the flat KV pools. A block
returns to the free list when its last reference is dropped; free blocks are reused oldest first.

Prefix caching (optional, as vLLM's): a full computed block is registered under a hash of its
sequence's cache domain and every token up to its end (a chain: sha256 of the previous block's
hash and this block's tokens, rooted in the domain, e.g. the tenant: another domain's prompts
are never matched, so cache timing says nothing across tenants). The model, tokenizer and KV
dtype are the engine's own, and a block's place in the chain fixes its positions. A
freed block keeps its K/V and its hash until it is reused, so a later sequence whose prompt
starts with the same full blocks takes them instead of computing them again, whether they are
still held by another sequence or already free. Only full blocks are shared, and a sequence
always computes at least its last prompt token itself, so no one writes into a shared block.
"""

from __future__ import annotations

import hashlib
import struct

from engine.sequence import Sequence


def block_hashes(
    token_ids: list[int],
    block_size: int,
    known: list[bytes],
    num_blocks: int | None = None,
    domain: str = "",
) -> list[bytes]:
    """The chain hashes of the first `num_blocks` (default: every) full blocks of `token_ids`
    in cache domain `domain`; `known`, the hashes already computed for a prefix of them, is
    extended in place."""
    full = len(token_ids) // block_size
    for i in range(len(known), full if num_blocks is None else min(num_blocks, full)):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = known[-1] if known else hashlib.sha256(domain.encode()).digest()
        known.append(hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block)).digest())
    return known


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # oldest first
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_of: list[bytes | None] = [None] * num_blocks  # a registered block's hash
        self._cached: dict[bytes, int] = {}  # hash -> the block holding those tokens' K/V

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

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
        new_ids = [self._take_free() for _ in range(n)]
        seq.block_table.extend(new_ids)
        return new_ids

    def _take_free(self) -> int:
        """The oldest free block; a cached one is evicted (its K/V will be overwritten)."""
        block_id = next(iter(self._free_block_ids))
        del self._free_block_ids[block_id]
        assert self.ref_counts[block_id] == 0, f"free block {block_id} is still referenced"
        self.ref_counts[block_id] = 1
        h = self._hash_of[block_id]
        if h is not None:
            del self._cached[h]
            self._hash_of[block_id] = None
        return block_id

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix of full
        blocks (never its last token's block); -> the tokens it no longer computes."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "take for a fresh sequence"
        if not self.enable_prefix_caching or seq.needs_prompt_logits:
            return 0
        hashes = block_hashes(
            seq.token_ids, self.block_size, seq.block_hashes, domain=seq.cache_domain
        )
        usable = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        for h in hashes[:usable]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self.ref_counts[block_id] == 0:
                del self._free_block_ids[block_id]  # revived: no longer free
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_offered_blocks = len(seq.block_table)  # found there: registered already
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose K/V are now computed (after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_offered_blocks:
            return
        hashes = block_hashes(
            seq.token_ids, self.block_size, seq.block_hashes, num_full, seq.cache_domain
        )
        for i in range(seq.num_offered_blocks, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            if self._hash_of[block_id] is None and h not in self._cached:
                self._cached[h] = block_id
                self._hash_of[block_id] = h
        seq.num_offered_blocks = num_full

    def fork(self, parent: Sequence, child: Sequence, max_tokens: int | None = None) -> int:
        """Share the parent's full computed blocks with a child (prefix sharing, no copy), at
        most `max_tokens` tokens' worth.

        Only full blocks are shared, so neither sequence ever writes into a shared block.
        Returns the number of tokens the child gets for free.
        """
        assert not child.block_table, "fork into a sequence that holds no blocks"
        num_computed = parent.num_computed_tokens
        if max_tokens is not None:
            num_computed = min(num_computed, max_tokens)
        num_full = num_computed // self.block_size
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
                self._free_block_ids[block_id] = None  # newest: reused (and evicted) last
        seq.block_table = []
        seq.num_offered_blocks = 0

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat KV slots of token positions [start, end) of `seq`."""
        bs, table = self.block_size, seq.block_table
        assert end <= len(table) * bs, f"positions up to {end} but only {len(table)} blocks"
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
