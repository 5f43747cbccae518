"""The edge's metrics from the events it sees: vLLM's names with `brigade:`, every series
labelled with the model; preemptions and prefix-cache queries / hits from each run's end."""

from schemas.events import RunCompleted, RunFinished, TokensGenerated, Usage
from stages.edge.metrics import EdgeMetrics


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


def test_iteration_tokens_from_each_steps_first_tokens_event():
    metrics = EdgeMetrics("m")
    for step_tokens in (512, 3, None):  # None: not its step's first event
        metrics.observe_event(
            TokensGenerated(request_id="r", seq=0, token_ids=[1], num_step_tokens=step_tokens)
        )
    got = _samples(metrics)
    assert got['brigade:iteration_tokens_total_count{model_name="m"}'] == 2
    assert got['brigade:iteration_tokens_total_sum{model_name="m"}'] == 515
    assert got['brigade:iteration_tokens_total_bucket{le="8.0",model_name="m"}'] == 1


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
