"""Prometheus metrics of the edge, named like vLLM's (`vllm:` -> `brigade:`), every series
labelled with the served `model_name`.

Latencies are measured at the edge (submit -> first delta -> each delta -> end); queue, prefill
and decode times, time per output token and the engine gauges come from the engine's `finished`
/ `tokens` events; token counts per request from each run's end; per-stage durations from each
event's `service_ns`; preemptions and the prefix cache's queries and hits (prompt tokens looked
up, and found cached) from each run's `finished`. One registry per app, so tests never clash.
`iteration_tokens_total` (tokens per engine step) from the first tokens event of each step,
so it counts the steps that gave one of this edge's runs a token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCancelled,
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
# vLLM's buckets: TTFT up to 2560 s, per-token times up to 80 s, request times up to 7680 s.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0)  # fmt: skip
_LONG = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
_STAGE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
_LABEL = "model_name"


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's request token buckets)."""
    buckets, scale = [], 1
    while scale <= max_model_len:
        buckets += [float(m * scale) for m in (1, 2, 5) if m * scale <= max_model_len]
        scale *= 10
    return tuple(buckets)


class EdgeMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.model_name = model = model_name
        self.registry = r = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, [_LABEL], registry=r, buckets=buckets).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, [_LABEL], registry=r).labels(model)

        self.ttft = histogram(
            "brigade:time_to_first_token_seconds", "Submit to first text delta.", _TTFT
        )
        self.itl = histogram(
            "brigade:inter_token_latency_seconds", "Between consecutive text deltas.", _PER_TOKEN
        )
        self.tpot = histogram(
            "brigade:time_per_output_token_seconds",
            "A request's decode time per output token after the first.", _PER_TOKEN,
        )  # fmt: skip
        self.e2e = histogram(
            "brigade:e2e_request_latency_seconds", "Submit to the run's end.", _LONG
        )
        self.queue = histogram(
            "brigade:request_queue_time_seconds", "Waiting for admission into the engine.", _LONG
        )
        self.prefill = histogram(
            "brigade:request_prefill_time_seconds", "Engine admission to first token.", _LONG
        )
        self.decode = histogram(
            "brigade:request_decode_time_seconds", "Engine first token to finish.", _LONG
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "brigade:request_prompt_tokens", "Prompt tokens of each finished request.", tokens
        )
        self.request_generation_tokens = histogram(
            "brigade:request_generation_tokens", "Generated tokens of each finished request.",
            tokens,
        )  # fmt: skip
        self._stage = Histogram(
            "brigade:stage_duration_seconds", "A stage's own service time per event.",
            [_LABEL, "stage"], registry=r, buckets=_STAGE,
        )  # fmt: skip
        self.running = gauge("brigade:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge(
            "brigade:num_requests_waiting", "Requests waiting for engine admission."
        )
        self.kv_usage = gauge(
            "brigade:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."
        )
        self.open_streams = gauge("brigade:edge_open_streams", "Runs this edge is streaming now.")
        self._success = Counter(
            "brigade:request_success", "Finished runs by finish reason.",
            [_LABEL, "finished_reason"], registry=r,
        )  # fmt: skip
        self._failure = Counter(
            "brigade:request_failure", "Failed runs by error code.", [_LABEL, "code"], registry=r
        )
        self.prompt_tokens = Counter(
            "brigade:prompt_tokens", "Prefilled tokens.", [_LABEL], registry=r
        ).labels(model)
        self.generation_tokens = Counter(
            "brigade:generation_tokens", "Generated tokens.", [_LABEL], registry=r
        ).labels(model)
        self.iteration_tokens = histogram(
            "brigade:iteration_tokens_total", "Tokens computed per engine step.", _ITERATION
        )
        self.preemptions = Counter(
            "brigade:num_preemptions", "Preemptions of runs by the engine.", [_LABEL], registry=r
        ).labels(model)
        self.prefix_queries = Counter(
            "brigade:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            [_LABEL], registry=r,
        ).labels(model)  # fmt: skip
        self.prefix_hits = Counter(
            "brigade:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            [_LABEL], registry=r,
        ).labels(model)  # fmt: skip

    def observe_event(self, event: AnyEvent) -> None:
        stage = STAGE_OF_EVENT.get(type(event).__struct_config__.tag)  # type: ignore[arg-type]
        if stage is not None and event.service_ns > 0:
            self._stage.labels(self.model_name, stage).observe(event.service_ns / 1e9)
        if isinstance(event, TokensGenerated | RunFinished):
            if event.num_running is not None:
                self.running.set(event.num_running)
            if event.num_waiting is not None:
                self.waiting.set(event.num_waiting)
            if event.kv_usage is not None:
                self.kv_usage.set(event.kv_usage)
        if isinstance(event, TokensGenerated) and event.num_step_tokens is not None:
            self.iteration_tokens.observe(event.num_step_tokens)
        if isinstance(event, RunFinished):
            self.queue.observe(event.queue_ns / 1e9)
            self.prefill.observe(event.prefill_ns / 1e9)
            self.decode.observe(event.decode_ns / 1e9)
            if event.usage.completion_tokens > 1:
                self.tpot.observe(event.decode_ns / 1e9 / (event.usage.completion_tokens - 1))
            self.preemptions.inc(event.num_preemptions)
            self.prefix_queries.inc(event.usage.prompt_tokens)
            self.prefix_hits.inc(event.usage.cached_tokens)
        elif isinstance(event, RunCompleted | RunCancelled):
            if isinstance(event, RunCompleted):
                self._success.labels(self.model_name, event.finish_reason).inc()
            else:
                self._success.labels(self.model_name, "abort").inc()
            self.prompt_tokens.inc(event.usage.prompt_tokens)
            self.generation_tokens.inc(event.usage.completion_tokens)
            self.request_prompt_tokens.observe(event.usage.prompt_tokens)
            self.request_generation_tokens.observe(event.usage.completion_tokens)
        elif isinstance(event, RequestFailed):
            self._failure.labels(self.model_name, event.code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
