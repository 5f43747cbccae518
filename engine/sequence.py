"""Sequence: the engine's state for one request (its tokens, how many have KV, its blocks).

Invariant: 0 <= num_computed_tokens <= len(token_ids), and the block table holds enough blocks
for the computed tokens. There is no prefill or decode phase: a step computes some of the
tokens that have no KV yet, and a token is sampled once every token has been computed.
A constrained request's grammar matcher is part of its state: it has accepted exactly the
output tokens (engine/grammar.py), so it survives preemption (the tokens are kept) unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import RequestRejected
from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the seed actually used (assigned by the engine when params.seed is None)
    arrival: int  # admission order; FCFS within a priority class
    priority: int = 0  # 0 = interactive, 1 = batch; lower runs first
    token_ids: list[int] = field(default_factory=list)  # prompt + output; filled in post_init
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with params.prompt_logprobs: entry i is prompt token i + 1's (its own first, then top-n)
    prompt_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache or a fork
    cache_domain: str = ""  # prefix-cache domain (a tenant): only its own prefixes match
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain, full blocks
    num_offered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    grammar: Matcher | None = None  # with params.constraint: where the output is in its grammar
    # parallel sampling (n > 1): the sequence whose prompt K/V this one shares, once computed
    fork_parent: Sequence | None = None
    # a continuation: the prompt's last tokens are this request's own earlier output (penalties
    # count them as output; draws continue at their position)
    num_prior_output: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise RequestRejected(
                "invalid_request",
                f"request {self.request_id!r}: the prompt has no tokens",
                field="prompt_token_ids",
            )
        if self.priority not in (0, 1):
            raise RequestRejected(
                "invalid_request",
                f"request {self.request_id!r}: priority={self.priority!r}; "
                "allowed: 0 (interactive) or 1 (batch)",
                field="priority",
            )
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        assert self.token_ids[: len(self.prompt_token_ids)] == self.prompt_token_ids, (
            "token_ids must start with the prompt"
        )
        assert 0 <= self.num_computed_tokens <= len(self.token_ids), (
            f"num_computed_tokens={self.num_computed_tokens} outside [0, {len(self.token_ids)}]"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs are asked for and not all computed: every prompt position's logits
        are needed, so none of its prompt may come from the prefix cache."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: interactive before batch, then first come first served."""
        return (self.priority, self.arrival)

    def append_token(self, token_id: int) -> None:
        assert self.num_computed_tokens == len(self.token_ids), (
            "a token is sampled only once every earlier token has been computed"
        )
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; prompt + output so far are prefilled again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_offered_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
