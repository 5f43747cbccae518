"""Admission at the edge: bounded waiting work, refused fast (503 `overloaded`) past the bound.

Waiting work is the reserved tokens (prompt estimate + max_tokens) of runs this edge submitted
that have not produced their first token yet. A run is refused when it would push waiting work
past the bound (batch tenants only up to `batch_share` of it, so interactive tenants keep
headroom), or when the engine reports its KV cache above the watermark with requests already
queued. The engine's own admission then decides what runs first (interactive before batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCancelled,
    RunCompleted,
    RunFinished,
    TextGenerated,
    TokensGenerated,
)
from stages.edge.errors import RequestError


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    max_waiting_tokens: int = 65536
    kv_watermark: float = 0.95
    batch_share: float = 0.5
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens={self.max_waiting_tokens} must be >= 1")
        if not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError(f"kv_watermark={self.kv_watermark} must be in (0, 1]")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError(f"batch_share={self.batch_share} must be in (0, 1]")


class AdmissionGate:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.waiting: dict[str, int] = {}
        self.num_waiting_tokens = 0
        self.kv_usage: float | None = None
        self.engine_waiting: int | None = None

    def admit(self, request_id: str, tokens: int, priority: str = "interactive") -> None:
        c = self.config
        bound = (
            c.max_waiting_tokens
            if priority == "interactive"
            else int(c.max_waiting_tokens * c.batch_share)
        )
        if self.num_waiting_tokens + tokens > bound:
            raise RequestError(
                "overloaded",
                f"{self.num_waiting_tokens} tokens already wait for the engine and this request "
                f"reserves {tokens}; the bound for {priority} work is {bound} "
                "(BRIGADE_EDGE_MAX_WAITING_TOKENS); retry shortly",
                retry_after_s=c.retry_after_s,
            )
        kv, queued = self.kv_usage, self.engine_waiting
        if kv is not None and kv >= c.kv_watermark and queued:
            raise RequestError(
                "overloaded",
                f"engine KV cache at {kv:.0%} (watermark {c.kv_watermark:.0%}, "
                f"BRIGADE_EDGE_KV_WATERMARK) with {queued} requests queued; retry shortly",
                retry_after_s=c.retry_after_s,
            )
        self.waiting[request_id] = tokens
        self.num_waiting_tokens += tokens

    def release(self, request_id: str) -> None:
        tokens = self.waiting.pop(request_id, None)
        if tokens is not None:
            self.num_waiting_tokens -= tokens

    def observe(self, event: AnyEvent) -> None:
        """Engine gauges, and the end of a run's wait (its first token, or its end)."""
        if isinstance(event, TokensGenerated | RunFinished):
            if event.kv_usage is not None:
                self.kv_usage = event.kv_usage
            if event.num_waiting is not None:
                self.engine_waiting = event.num_waiting
        if isinstance(
            event, TokensGenerated | TextGenerated | RunFinished | RunCompleted | RunCancelled
        ) or isinstance(event, RequestFailed):
            self.release(event.request_id)
