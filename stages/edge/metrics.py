"""Prometheus metrics of the edge, named like vLLM's (`vllm:` -> `brigade:`), every series
labelled with its run's `model_name` (each served model has its own series).

Latencies are measured at the edge (submit -> first delta -> each delta -> end); queue, prefill
and decode times, time per output token and the engine gauges come from the engine's `finished`
/ `tokens` events; token counts per request from each run's end; per-stage durations from each
event's `service_ns`; preemptions and the prefix cache's queries and hits (prompt tokens looked
up, and found cached) from each run's `finished`. One registry per app, so tests never clash.
`iteration_tokens_total` (tokens per engine step) is each live engine worker's own histogram,
from its heartbeat (labelled with its model and worker, as vLLM labels an engine's): it counts
every step, whoever submitted the runs in it (this edge, another, or a client on NATS).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCancelled,
    RunCompleted,
    RunFinished,
    RunStarted,
    TokensGenerated,
)

STAGE_OF_EVENT = {
    "accepted": "gateway",
    "authorized": "auth",
    "assembled": "context",
    "tokenized": "tokenize",
    "finished": "engine",  # its time on the run (a live watch takes `tokens` only for logprobs)
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
# to 1 s for the light stages' events, on to 300 s for the engine's whole runs
_STAGE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 2.5,
          5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # fmt: skip
_LABEL = "model_name"


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's request token buckets)."""
    buckets, scale = [], 1
    while scale <= max_model_len:
        buckets += [float(m * scale) for m in (1, 2, 5) if m * scale <= max_model_len]
        scale *= 10
    return tuple(buckets)


class EdgeMetrics:
    """The families, labelled by model; `of(model)` is one model's series (every served model
    has its own from the start, so each appears in /metrics before its first request)."""

    def __init__(self, model_name: str | Sequence[str], max_model_len: int = 8192) -> None:
        names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.model_name = names[0]  # the default: events that name no model count for it
        self.registry = r = CollectorRegistry()
        self._families: dict[str, Histogram | Gauge | Counter] = {}

        def histogram(key: str, name: str, doc: str, buckets: tuple[float, ...]) -> None:
            self._families[key] = Histogram(name, doc, [_LABEL], registry=r, buckets=buckets)

        def gauge(key: str, name: str, doc: str) -> None:
            self._families[key] = Gauge(name, doc, [_LABEL], registry=r)

        def counter(key: str, name: str, doc: str) -> None:
            self._families[key] = Counter(name, doc, [_LABEL], registry=r)

        histogram("ttft", "brigade:time_to_first_token_seconds", "Submit to first text delta.", _TTFT)  # fmt: skip
        histogram("itl", "brigade:inter_token_latency_seconds", "Between consecutive text deltas.", _PER_TOKEN)  # fmt: skip
        histogram(
            "tpot", "brigade:time_per_output_token_seconds",
            "A request's decode time per output token after the first.", _PER_TOKEN,
        )  # fmt: skip
        histogram("e2e", "brigade:e2e_request_latency_seconds", "Submit to the run's end.", _LONG)
        histogram("queue", "brigade:request_queue_time_seconds", "Waiting for admission into the engine.", _LONG)  # fmt: skip
        histogram("prefill", "brigade:request_prefill_time_seconds", "Engine admission to first token.", _LONG)  # fmt: skip
        histogram("decode", "brigade:request_decode_time_seconds", "Engine first token to finish.", _LONG)  # fmt: skip
        tokens = token_buckets(max_model_len)
        histogram("request_prompt_tokens", "brigade:request_prompt_tokens", "Prompt tokens of each finished request.", tokens)  # fmt: skip
        histogram("request_generation_tokens", "brigade:request_generation_tokens", "Generated tokens of each finished request.", tokens)  # fmt: skip
        gauge("running", "brigade:num_requests_running", "Requests in the running batch.")
        gauge("waiting", "brigade:num_requests_waiting", "Requests waiting for engine admission.")
        gauge("kv_usage", "brigade:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")  # fmt: skip
        gauge("open_streams", "brigade:edge_open_streams", "Runs this edge is streaming now.")
        counter("prompt_tokens", "brigade:prompt_tokens", "Prefilled tokens.")
        counter("generation_tokens", "brigade:generation_tokens", "Generated tokens.")
        counter("preemptions", "brigade:num_preemptions", "Preemptions of runs by the engine.")
        counter("prefix_queries", "brigade:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")  # fmt: skip
        counter("prefix_hits", "brigade:prefix_cache_hits", "Prompt tokens found in the prefix cache.")  # fmt: skip
        self._stage = Histogram(
            "brigade:stage_duration_seconds", "A stage's own service time per event.",
            [_LABEL, "stage"], registry=r, buckets=_STAGE,
        )  # fmt: skip
        self._success = Counter(
            "brigade:request_success", "Finished runs by finish reason.",
            [_LABEL, "finished_reason"], registry=r,
        )  # fmt: skip
        self._failure = Counter(
            "brigade:request_failure", "Failed runs by error code.", [_LABEL, "code"], registry=r
        )
        self.engines = EngineSteps()
        r.register(self.engines)
        self._series: dict[str, ModelSeries] = {}
        for name in names:
            self.of(name)

    def of(self, model: str | None) -> ModelSeries:
        """One model's series (None: the default model's)."""
        model = model or self.model_name
        found = self._series.get(model)
        if found is None:
            found = self._series[model] = ModelSeries(
                model, {key: family.labels(model) for key, family in self._families.items()}
            )
        return found

    def observe_event(self, event: AnyEvent, model: str | None = None) -> None:
        """Count `event` for its model: the one it names (tokens, finished), else `model` (the
        run's, as the edge resolved it), else the default."""
        model = getattr(event, "model", None) or model or self.model_name
        m = self.of(model)
        stage = STAGE_OF_EVENT.get(type(event).__struct_config__.tag)  # type: ignore[arg-type]
        if stage is not None and event.service_ns > 0:
            self._stage.labels(model, stage).observe(event.service_ns / 1e9)
        if isinstance(event, RunStarted | TokensGenerated | RunFinished):
            if event.num_running is not None:
                m.running.set(event.num_running)
            if event.num_waiting is not None:
                m.waiting.set(event.num_waiting)
            if event.kv_usage is not None:
                m.kv_usage.set(event.kv_usage)
        if isinstance(event, RunFinished):
            m.queue.observe(event.queue_ns / 1e9)
            m.prefill.observe(event.prefill_ns / 1e9)
            m.decode.observe(event.decode_ns / 1e9)
            if event.usage.completion_tokens > 1:
                m.tpot.observe(event.decode_ns / 1e9 / (event.usage.completion_tokens - 1))
            m.preemptions.inc(event.num_preemptions)
            m.prefix_queries.inc(event.usage.prompt_tokens)
            m.prefix_hits.inc(event.usage.cached_tokens)
        elif isinstance(event, RunCompleted | RunCancelled):
            if isinstance(event, RunCompleted):
                self._success.labels(model, event.finish_reason).inc()
            else:
                self._success.labels(model, "abort").inc()
            m.prompt_tokens.inc(event.usage.prompt_tokens)
            m.generation_tokens.inc(event.usage.completion_tokens)
            m.request_prompt_tokens.observe(event.usage.prompt_tokens)
            m.request_generation_tokens.observe(event.usage.completion_tokens)
        elif isinstance(event, RequestFailed):
            self._failure.labels(model, event.code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineSteps:
    """`iteration_tokens_total`: the step-size histogram each live engine worker reports in its
    heartbeat (stages/engine.py StepTokens), one series per worker; `update` at each scrape."""

    NAME = "brigade:iteration_tokens_total"

    def __init__(self) -> None:
        self.workers: list[tuple[str, str, dict[str, Any]]] = []  # (model, worker, histogram)

    def update(self, beats: Sequence[Any]) -> None:
        self.workers = [
            (str(b.detail.get("model", "")), b.worker, b.detail["iteration_tokens"])
            for b in beats
            if b.stage == "engine" and isinstance(b.detail.get("iteration_tokens"), dict)
        ]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self.NAME, "Tokens computed per engine step.", labels=[_LABEL, "engine"]
        )
        for model, worker, h in self.workers:
            try:
                counts = [int(c) for c in h["cumulative"]]
                bounds = [floatToGoString(float(le)) for le in h["le"]]
                buckets = [*zip(bounds, counts[:-1], strict=True), ("+Inf", counts[-1])]
                family.add_metric([model, worker], buckets, sum_value=float(h["sum"]))
            except (KeyError, TypeError, ValueError):  # a worker of another version: left out
                continue
        yield family


class ModelSeries:
    """One model's child of every family: `series.ttft.observe(...)`."""

    def __init__(self, model: str, children: dict[str, Any]) -> None:
        self.model = model
        self.__dict__.update(children)
