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


def test_over_allocation_and_bad_sizes():
    bm = BlockManager(num_blocks=1, block_size=4)
    with pytest.raises(AssertionError, match="call can_allocate first"):
        bm.allocate(seq(5), 5)
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(num_blocks=0, block_size=4)
