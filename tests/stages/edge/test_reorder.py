import pytest

from stages.edge.reorder import ReorderBuffer, ReorderOverflow


def test_in_order_passes_straight_through():
    buf = ReorderBuffer[str]()
    assert buf.push(0, "a") == ["a"]
    assert buf.push(1, "b") == ["b"]
    assert buf.next_seq == 2
    assert buf.complete(1)


def test_out_of_order_is_held_until_the_gap_fills():
    buf = ReorderBuffer[str]()
    assert buf.push(2, "c") == []
    assert buf.push(1, "b") == []
    assert buf.missing() == [0]
    assert buf.num_held == 2
    assert buf.push(0, "a") == ["a", "b", "c"]
    assert buf.num_held == 0
    assert buf.next_seq == 3


def test_duplicates_never_released_twice():
    buf = ReorderBuffer[str]()
    assert buf.push(0, "a") == ["a"]
    assert buf.push(0, "a") == []
    assert buf.push(2, "c") == []
    assert buf.push(2, "c") == []
    assert buf.push(1, "b") == ["b", "c"]
    assert buf.num_duplicates == 2


def test_resume_starts_after_a_seq():
    buf = ReorderBuffer[str](start=5)
    assert buf.push(3, "old") == []
    assert buf.push(5, "f") == ["f"]
    assert not buf.complete(7)
    assert buf.missing(7) == [6, 7]


def test_complete_with_no_deltas():
    assert ReorderBuffer[str]().complete(None)
    assert not ReorderBuffer[str]().complete(0)


def test_overflow_names_the_gap_and_the_knob():
    buf = ReorderBuffer[int](max_held=2)
    buf.push(1, 1)
    buf.push(2, 2)
    with pytest.raises(ReorderOverflow, match=r"waiting for seq 0 \(max_held=2\)"):
        buf.push(3, 3)
