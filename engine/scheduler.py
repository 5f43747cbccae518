"""Scheduler: iteration-level continuous batching in the style of vLLM v1.

There is no prefill phase and no decode phase. Each sequence has `num_computed_tokens` catching
up with its `token_ids`; a step gives every sequence some of its missing tokens within a token
budget, which covers decodes (1 token), chunked prefills (part of a prompt) and recompute after
preemption alike. Order is (priority, arrival): interactive before batch, FCFS within a class.
Every running sequence is guaranteed at least one token per step, so a long prompt being
prefilled in chunks never stalls the decodes running beside it. When blocks run out, the last
sequence in that order is preempted by recompute: its blocks are freed and it waits again.
A decode may carry a speculative draft (engine/spec_decode.py): its tokens are computed in the
same chunk; `update` takes the verified run and keeps the K/V of the accepted draft tokens.
Parallel sampling: a sequence with a `fork_parent` (the same prompt) waits until the parent has
computed its prompt's full blocks, then shares them (BlockManager.fork) and computes only the
rest, so those blocks are prefilled once for all.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}; allowed: >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                f"{self.max_num_seqs}: every running sequence needs at least one token per step; "
                "raise max_num_batched_tokens or lower max_num_seqs"
            )


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (num_computed_tokens before the step)
    num_new_tokens: int  # the sequence's own tokens plus the draft's
    draft: tuple[int, ...] = ()  # speculative tokens after the last one (decodes only)

    @property
    def num_real_tokens(self) -> int:
        return self.num_new_tokens - len(self.draft)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last token, so the step samples the next one."""
        return self.start + self.num_real_tokens == self.seq.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Rows of logits this chunk gets: its last token's, then one per draft token."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found cached (not computed again)
        self.num_forked_tokens = 0  # prompt tokens forked from a parent (not computed again)
        self.num_draft_tokens = 0  # speculative tokens verified
        self.num_accepted_draft_tokens = 0  # of those, tokens the model agreed with

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """drafts: speculative tokens per request id, for running decodes; a draft is cut to
        the budget, and dropped when its blocks would not fit."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)
        drafts = drafts or {}
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            reserved = len(self.running) - i - 1  # one token for each running seq after this one
            num_new = min(seq.num_uncomputed_tokens, budget - reserved)
            assert num_new >= 1, f"running seq {seq.request_id} got {num_new} tokens"
            draft = drafts.get(seq.request_id, [])
            if draft and seq.num_uncomputed_tokens == 1:
                draft = draft[: max(0, budget - reserved - num_new)]
                if draft and self.block_manager.can_allocate(seq, num_new + len(draft)):
                    self._schedule(out, seq, num_new + len(draft), tuple(draft))
                    budget -= num_new + len(draft)
                    i += 1
                    continue
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # last in (priority, arrival) order
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._schedule(out, seq, num_new)
                budget -= num_new
                i += 1
        if out.preempted:
            return out  # memory is tight: admit nobody new this step
        while self.waiting and budget > 0:
            seq = next((s for s in self.waiting if not self._held(s)), None)
            if seq is None:
                break
            forked = bool(seq.block_table)  # its prompt's shared blocks (kept while it waits)
            cached = 0 if forked else self.block_manager.take_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            fits = len(self.running) < self.config.max_num_seqs and self.block_manager.can_allocate(
                seq, num_new
            )
            if not fits:
                if cached:  # give the prefix back; it is looked up again on the next try
                    self.block_manager.free(seq)
                    seq.num_computed_tokens = 0
                # An interactive request may take the place of a running batch request.
                victim = max(self.running, key=lambda s: s.sort_key, default=None)
                if victim is not None and victim.priority > seq.priority:
                    self.running.remove(victim)
                    budget += self._unschedule(out, victim)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    continue
                break
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:  # as vLLM reports it: the first admission's
                seq.num_cached_tokens = seq.num_computed_tokens
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(out, seq, num_new)
            budget -= num_new
        return out

    @staticmethod
    def _held(seq: Sequence) -> bool:
        """A fork child waits while its parent lives and has not shared its prompt yet."""
        parent = seq.fork_parent
        return parent is not None and not seq.block_table and not parent.is_finished

    def _fork_children(self, parent: Sequence) -> None:
        """Share the parent's computed prompt blocks with the children waiting for them, once
        they are all computed (before the parent may finish and free them)."""
        bs = self.block_manager.block_size
        prompt_blocks = (parent.num_prompt_tokens - 1) // bs  # a child computes its last token
        if parent.num_computed_tokens < prompt_blocks * bs:
            return
        for child in self.waiting:
            if child.fork_parent is parent and not child.block_table:
                shared = self.block_manager.fork(parent, child, prompt_blocks * bs)
                self.num_forked_tokens += shared
                child.fork_parent = None  # done: it no longer waits for the parent

    def _schedule(
        self, out: SchedulerOutput, seq: Sequence, num_new: int, draft: tuple[int, ...] = ()
    ) -> None:
        self.block_manager.allocate(seq, num_new)
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, draft))

    def _unschedule(self, out: SchedulerOutput, seq: Sequence) -> int:
        for k, s in enumerate(out.scheduled):
            if s.seq is seq:
                del out.scheduled[k]
                return s.num_new_tokens
        return 0

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def update(
        self,
        out: SchedulerOutput,
        new_token_ids: list[list[int]],
        logprobs: list[list[list[tuple[int, float]] | None]] | None,
        eos_token_id: int,
    ) -> list[tuple[Sequence, int]]:
        """Advance computed tokens, append the new tokens, finish stopped sequences.

        `new_token_ids` holds one entry per chunk that samples (`s.samples`), in scheduling
        order: the tokens verified for it (engine/spec_decode.py), its accepted draft tokens
        and then one more; a chunk without a draft gets one token. `logprobs`, when given, is
        aligned with it token by token. The accepted draft tokens' K/V were computed in this
        step with the right tokens, so they count as computed; the rest of the draft is dropped.
        Returns (sequence, tokens it received) for the sequences that received any.
        """
        updated = []
        k = 0  # entries of new_token_ids used
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_real_tokens
            self.block_manager.cache_full_blocks(seq)
            self._fork_children(seq)
            if not s.samples:
                continue
            token_ids = new_token_ids[k]
            token_logprobs = None if logprobs is None else logprobs[k]
            k += 1
            assert 1 <= len(token_ids) <= s.num_sampled_rows, (
                f"{len(token_ids)} tokens for {seq.request_id}'s {s.num_sampled_rows} rows"
            )
            num_received = 0
            for j, token_id in enumerate(token_ids):
                if token_logprobs is not None and seq.params.logprobs is not None:
                    seq.logprobs.append(token_logprobs[j])
                seq.append_token(token_id)
                num_received += 1
                reason = self._stop_reason(seq, token_id, eos_token_id)
                if reason is not None:
                    self.finish(seq, reason)
                    break
                if j < len(token_ids) - 1:  # an accepted draft token: its K/V are the right ones
                    seq.num_computed_tokens += 1
                    self.block_manager.cache_full_blocks(seq)
                    self.num_accepted_draft_tokens += 1
            self.num_draft_tokens += len(s.draft)
            updated.append((seq, num_received))
        assert k == len(new_token_ids), f"{len(new_token_ids)} token runs for {k} sampling chunks"
        return updated

    def _stop_reason(self, seq: Sequence, token_id: int, eos_token_id: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens and (
            (token_id == eos_token_id and not p.ignore_eos) or token_id in p.stop_token_ids
        ):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence (stopped, too long or aborted) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
