"""The edge's metrics from the events it sees: vLLM's names with `brigade:`, every series
labelled with the model; preemptions and prefix-cache queries / hits from each run's end."""

from schemas.events import RunCompleted, RunFinished, RunStarted, TokensGenerated, Usage
from stages.edge.metrics import EdgeMetrics
from stages.engine import StepTokens
from stages.runtime.heartbeat import Beat


def _samples(metrics: EdgeMetrics) -> dict[str, float]:
    lines = metrics.exposition().decode().splitlines()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in lines
        if line and not line.startswith("#")
    }


def test_preemptions_and_prefix_cache_counters_come_from_each_runs_end():
    metrics = EdgeMetrics("m")
    for cached, preempted in ((0, 0), (32, 2), (16, 0)):
        usage = Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=cached)
        metrics.observe_event(
            RunFinished(
                request_id="r", finish_reason="stop", usage=usage, num_preemptions=preempted
            )  # fmt: skip
        )
    got = _samples(metrics)
    assert got['brigade:num_preemptions_total{model_name="m"}'] == 2
    assert got['brigade:prefix_cache_queries_total{model_name="m"}'] == 120
    assert got['brigade:prefix_cache_hits_total{model_name="m"}'] == 48
    assert got['brigade:time_per_output_token_seconds_count{model_name="m"}'] == 3
    assert all('model_name="m"' in name for name in got)


def test_iteration_tokens_are_each_engine_workers_own_from_its_heartbeat():
    """The engine counts every step it computes; the edge serves each live worker's histogram
    as it beats, labelled with the worker's model and id (another stage's beat adds none)."""
    steps = StepTokens()
    for num_tokens in (512, 3, 1, 20000):
        steps.observe(num_tokens)
    engine = Beat(stage="engine", worker="h-1-0", host="h", pid=1, ready=True,
                  detail={"model": "tiny", "iteration_tokens": steps.as_detail()})  # fmt: skip
    other = Beat(stage="tokenize", worker="h-1-1", host="h", pid=1, ready=True)
    metrics = EdgeMetrics(["m", "tiny"])
    metrics.engines.update([engine, other])
    got = _samples(metrics)
    series = 'engine="h-1-0",{}model_name="tiny"'
    assert got["brigade:iteration_tokens_total_count{" + series.format("") + "}"] == 4
    assert got["brigade:iteration_tokens_total_sum{" + series.format("") + "}"] == 20516
    for le, count in (("1.0", 1), ("8.0", 2), ("512.0", 3), ("16384.0", 3), ("+Inf", 4)):
        name = "brigade:iteration_tokens_total_bucket{" + series.format(f'le="{le}",') + "}"
        assert got[name] == count, le
    assert not [n for n in got if "iteration" in n and "h-1-1" in n]


def test_every_series_is_labelled_with_its_runs_model():
    """Two served models: each has its series from the start; an event counts for the model it
    names, else for its run's (as the edge resolved it), else for the default."""
    metrics = EdgeMetrics(["m", "tiny"])
    names = _samples(metrics)
    assert 'brigade:num_requests_running{model_name="tiny"}' in names
    usage = Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4)
    metrics.observe_event(
        RunFinished(request_id="a", finish_reason="stop", usage=usage, model="tiny")
    )
    metrics.observe_event(RunCompleted(request_id="a", finish_reason="stop", usage=usage), "tiny")
    metrics.observe_event(RunFinished(request_id="b", finish_reason="stop", usage=usage))
    got = _samples(metrics)
    assert got['brigade:prefix_cache_hits_total{model_name="tiny"}'] == 4
    assert got['brigade:prefix_cache_hits_total{model_name="m"}'] == 4
    assert got['brigade:request_success_total{finished_reason="stop",model_name="tiny"}'] == 1
    assert got['brigade:generation_tokens_total{model_name="tiny"}'] == 2
    assert got['brigade:generation_tokens_total{model_name="m"}'] == 0
    assert all('model_name="' in name for name in got)


def test_engine_gauges_come_from_started_and_finished_and_its_stage_time_per_run():
    """A live watch takes no `tokens` without logprobs: the gauges come from each run's start
    and end, and the engine's stage time is its time on each run (from `finished`)."""
    metrics = EdgeMetrics("m")
    metrics.observe_event(RunStarted(request_id="r", num_running=5, num_waiting=2, kv_usage=0.5))
    got = _samples(metrics)
    assert got['brigade:num_requests_running{model_name="m"}'] == 5
    assert got['brigade:num_requests_waiting{model_name="m"}'] == 2
    assert got['brigade:kv_cache_usage_perc{model_name="m"}'] == 0.5
    metrics.observe_event(
        RunFinished(
            request_id="r",
            finish_reason="length",
            service_ns=4_000_000_000,
            num_running=4,
            num_waiting=0,
            kv_usage=0.25,
        )  # fmt: skip
    )
    metrics.observe_event(
        TokensGenerated(request_id="q", seq=3, token_ids=[1], service_ns=30_000_000)
    )
    got = _samples(metrics)
    assert got['brigade:num_requests_running{model_name="m"}'] == 4
    stage = 'model_name="m",stage="engine"'
    assert got[f"brigade:stage_duration_seconds_count{{{stage}}}"] == 1  # the run, not a step
    assert got[f"brigade:stage_duration_seconds_sum{{{stage}}}"] == 4.0
    assert got[f'brigade:stage_duration_seconds_bucket{{le="5.0",{stage}}}'] == 1
    assert got[f'brigade:stage_duration_seconds_bucket{{le="2.5",{stage}}}'] == 0
