"""Release a run's deltas in `seq` order, each exactly once, whatever order they arrive in.

Invariant: `released` is always the contiguous prefix 0..next_seq-1; an item is released only
after every smaller seq was, and a seq already released or already held is dropped.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ReorderOverflow(Exception):
    """Too many early arrivals are held behind a gap (a lost delta the log must fill)."""


class ReorderBuffer(Generic[T]):
    def __init__(self, *, start: int = 0, max_held: int = 4096) -> None:
        assert start >= 0, f"start seq must be >= 0, got {start}"
        self.next_seq = start
        self.max_held = max_held
        self._held: dict[int, T] = {}
        self.num_duplicates = 0

    def push(self, seq: int, item: T) -> list[T]:
        """Add one delta; returns the deltas now ready, in order (often just this one)."""
        if seq < self.next_seq or seq in self._held:
            self.num_duplicates += 1
            return []
        if seq != self.next_seq:
            if len(self._held) >= self.max_held:
                raise ReorderOverflow(
                    f"{len(self._held)} deltas held waiting for seq {self.next_seq} "
                    f"(max_held={self.max_held}); fill the gap from the log"
                )
            self._held[seq] = item
            return []
        ready = [item]
        self.next_seq += 1
        while self.next_seq in self._held:
            ready.append(self._held.pop(self.next_seq))
            self.next_seq += 1
        return ready

    @property
    def num_held(self) -> int:
        return len(self._held)

    def missing(self, last_seq: int | None = None) -> list[int]:
        """Seqs not yet seen up to `last_seq` (or up to the largest one held)."""
        top = max(self._held, default=self.next_seq - 1) if last_seq is None else last_seq
        return [s for s in range(self.next_seq, top + 1) if s not in self._held]

    def complete(self, last_seq: int | None) -> bool:
        """True once every seq up to `last_seq` was released (None: the run had no deltas)."""
        return last_seq is None or self.next_seq > last_seq
