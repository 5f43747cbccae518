"""Prometheus metrics of the edge, named like vLLM's (`vllm:` -> `brigade:`).

Latencies are measured at the edge (submit -> first delta -> each delta -> end); queue, prefill
and decode times and the engine gauges come from the engine's `finished` / `tokens` events;
per-stage durations from each event's `service_ns`. One registry per app, so tests never clash.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCompleted,
    RunFinished,
    TokensGenerated,
)

STAGE_OF_EVENT = {
    "accepted": "gateway",
    "authorized": "auth",
    "assembled": "context",
    "tokenized": "tokenize",
    "tokens": "engine",
    "text": "detokenize",
    "completed": "detokenize",
    "billed": "ledger",
}
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_LONG = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_STAGE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "brigade:time_to_first_token_seconds", "Submit to first text delta.", registry=r,
            buckets=_LATENCY,
        )  # fmt: skip
        self.itl = Histogram(
            "brigade:inter_token_latency_seconds", "Between consecutive text deltas.",
            registry=r, buckets=_LATENCY,
        )  # fmt: skip
        self.e2e = Histogram(
            "brigade:e2e_request_latency_seconds", "Submit to the run's end.", registry=r,
            buckets=_LONG,
        )  # fmt: skip
        self.queue = Histogram(
            "brigade:request_queue_time_seconds", "Waiting for admission into the engine.",
            registry=r, buckets=_LONG,
        )  # fmt: skip
        self.prefill = Histogram(
            "brigade:request_prefill_time_seconds", "Engine admission to first token.",
            registry=r, buckets=_LONG,
        )  # fmt: skip
        self.decode = Histogram(
            "brigade:request_decode_time_seconds", "Engine first token to finish.", registry=r,
            buckets=_LONG,
        )  # fmt: skip
        self.stage = Histogram(
            "brigade:stage_duration_seconds", "A stage's own service time per event.",
            ["stage"], registry=r, buckets=_STAGE,
        )  # fmt: skip
        self.running = Gauge(
            "brigade:num_requests_running", "Requests in the engine's running batch.", registry=r
        )
        self.waiting = Gauge(
            "brigade:num_requests_waiting", "Requests waiting for engine admission.", registry=r
        )
        self.kv_usage = Gauge(
            "brigade:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", registry=r
        )
        self.open_streams = Gauge(
            "brigade:edge_open_streams", "Runs this edge is streaming now.", registry=r
        )
        self.success = Counter(
            "brigade:request_success", "Finished runs by finish reason.", ["finished_reason"],
            registry=r,
        )  # fmt: skip
        self.failure = Counter(
            "brigade:request_failure", "Failed runs by error code.", ["code"], registry=r
        )
        self.prompt_tokens = Counter("brigade:prompt_tokens", "Prefilled tokens.", registry=r)
        self.generation_tokens = Counter(
            "brigade:generation_tokens", "Generated tokens.", registry=r
        )

    def observe_event(self, event: AnyEvent) -> None:
        stage = STAGE_OF_EVENT.get(type(event).__struct_config__.tag)  # type: ignore[arg-type]
        if stage is not None and event.service_ns > 0:
            self.stage.labels(stage).observe(event.service_ns / 1e9)
        if isinstance(event, TokensGenerated | RunFinished):
            if event.num_running is not None:
                self.running.set(event.num_running)
            if event.num_waiting is not None:
                self.waiting.set(event.num_waiting)
            if event.kv_usage is not None:
                self.kv_usage.set(event.kv_usage)
        if isinstance(event, RunFinished):
            self.queue.observe(event.queue_ns / 1e9)
            self.prefill.observe(event.prefill_ns / 1e9)
            self.decode.observe(event.decode_ns / 1e9)
        elif isinstance(event, RunCompleted):
            self.success.labels(event.finish_reason).inc()
            self.prompt_tokens.inc(event.usage.prompt_tokens)
            self.generation_tokens.inc(event.usage.completion_tokens)
        elif isinstance(event, RequestFailed):
            self.failure.labels(event.code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
