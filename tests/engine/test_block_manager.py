import pytest

from engine.block_manager import BlockManager
from engine.params import SamplingParams
from engine.sequence import Sequence


def seq(n, rid="r"):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(), seed=0, arrival=0)


def test_allocate_exact_ids_slots_and_free_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq(10, "a"), seq(3, "b")
    assert bm.num_new_blocks(a, 10) == 3
    assert bm.allocate(a, 10) == [0, 1, 2]
    assert bm.allocate(b, 3) == [3]
    assert bm.num_free_blocks == 2 and bm.ref_counts == [1, 1, 1, 1, 0, 0]
    assert bm.slot_mapping(a, 7, 10) == [7, 8, 9]
    assert bm.slot_mapping(b, 0, 3) == [12, 13, 14]
    # growing by one token inside the last block needs no block; crossing the boundary needs one
    a.num_computed_tokens = 10
    assert bm.num_new_blocks(a, 2) == 0
    assert bm.allocate(a, 2) == []
    assert bm.num_new_blocks(a, 3) == 1
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 5
    assert bm.ref_counts == [0, 0, 0, 1, 0, 0]
    c = seq(20, "c")
    assert bm.can_allocate(c, 20) and not bm.can_allocate(c, 21)
    assert bm.allocate(c, 20) == [4, 5, 0, 1, 2]  # FIFO reuse of freed blocks
    assert bm.slot_mapping(c, 8, 10) == [0, 1]
    assert bm.usage == 1.0


def test_fork_shares_full_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent, child = seq(10, "p"), seq(10, "c")
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    assert bm.fork(parent, child) == 8
    assert child.block_table == [0, 1] and bm.ref_counts == [2, 2, 1, 0]
    assert bm.allocate(child, 2) == [3]
    bm.free(parent)
    assert bm.ref_counts == [1, 1, 0, 1] and bm.num_free_blocks == 1
    bm.free(child)
    assert bm.ref_counts == [0, 0, 0, 0] and bm.num_free_blocks == 4
    parent.num_computed_tokens = 0
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    other = seq(10, "o")
    assert bm.fork(parent, other, max_tokens=7) == 4  # at most 7 tokens: one full block
    assert other.block_table == parent.block_table[:1]


def test_over_allocation_and_bad_sizes():
    bm = BlockManager(num_blocks=1, block_size=4)
    with pytest.raises(AssertionError, match="call can_allocate first"):
        bm.allocate(seq(5), 5)
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(num_blocks=0, block_size=4)


def prompt_seq(tokens, rid):
    return Sequence(rid, list(tokens), SamplingParams(), seed=0, arrival=0)


def computed(bm, s):
    """Allocate and 'compute' every token of `s`, then register its full blocks."""
    bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_prefix_cache_shares_full_blocks_and_keeps_the_last_token_computed():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = prompt_seq(range(10), "a")  # blocks 0, 1 full; block 2 holds tokens 8, 9
    computed(bm, a)
    assert a.block_table == [0, 1, 2] and bm.num_cached_blocks == 2
    b = prompt_seq([*range(8), 99, 98], "b")  # the same first 8 tokens, then its own
    assert bm.take_cached_prefix(b) == 8
    assert b.block_table == [0, 1] and bm.ref_counts == [2, 2, 1, 0, 0, 0]
    assert bm.allocate(b, 2) == [3] and bm.slot_mapping(b, 8, 10) == [12, 13]
    c = prompt_seq(range(8), "c")  # all 8 cached, but its last token must be computed
    assert bm.take_cached_prefix(c) == 4 and c.block_table == [0]
    d = prompt_seq([5, *range(1, 10)], "d")  # differs in the first block: nothing
    assert bm.take_cached_prefix(d) == 0 and d.block_table == []
    e = prompt_seq([*range(4), 7, 5, 6, 7, 8, 9], "e")  # first block only: a chain, not a set
    assert bm.take_cached_prefix(e) == 4 and e.block_table == [0]


def test_freed_cached_blocks_are_revived_or_evicted_oldest_first():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = prompt_seq(range(10), "a")
    computed(bm, a)  # blocks 0, 1 cached, 2 partial, 3 free
    bm.free(a)  # free order now 3, 0, 1, 2 (freed blocks are newest)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = prompt_seq([*range(8), 50], "b")
    assert bm.take_cached_prefix(b) == 8  # revived from the free list
    assert b.block_table == [0, 1] and bm.ref_counts == [1, 1, 0, 0] and bm.num_free_blocks == 2
    bm.free(b)
    c = prompt_seq(range(100, 112), "c")  # 3 new blocks: 3, then 2, then 0 (evicting it)
    assert bm.allocate(c, 12) == [3, 2, 0]
    assert bm.num_cached_blocks == 1  # block 1's tokens 4..7 stay, but their chain starts at 0
    assert bm.take_cached_prefix(prompt_seq(range(10), "again")) == 0


def test_a_block_computed_twice_is_registered_once():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a, b = prompt_seq(range(5), "a"), prompt_seq(range(5), "b")  # prefilled side by side
    computed(bm, a)
    computed(bm, b)
    assert (a.block_table, b.block_table, bm.num_cached_blocks) == ([0, 1], [2, 3], 1)
    bm.free(a)
    bm.free(b)
    assert bm.take_cached_prefix(prompt_seq(range(6), "c")) == 4
    assert bm.ref_counts == [1, 0, 0, 0]


def test_without_prefix_caching_nothing_is_cached():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = prompt_seq(range(10), "a")
    computed(bm, a)
    assert bm.num_cached_blocks == 0 and bm.take_cached_prefix(prompt_seq(range(10), "b")) == 0


def test_prefixes_are_shared_only_within_a_cache_domain():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = prompt_seq(range(10), "a")
    a.cache_domain = "tenant-a"
    computed(bm, a)
    other = prompt_seq(range(10), "b")
    other.cache_domain = "tenant-b"  # the same tokens in another domain: no match
    assert bm.take_cached_prefix(other) == 0
    same = prompt_seq(range(10), "c")
    same.cache_domain = "tenant-a"
    assert bm.take_cached_prefix(same) == 8 and same.block_table == [0, 1]
