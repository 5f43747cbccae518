"""Admission by estimated time: the runs waiting for a first token, at the start rate measured
from first tokens (or their prompts at the prefill rate learned from finished runs), plus the
new request's own prefill, against BRIGADE_EDGE_MAX_WAIT_S; Retry-After is the queue's time, and
each refusal after it is told to come one prefill (or one start, where starts are slower) later.
A burst into a quiet gate (nothing refused lately) is held to BRIGADE_EDGE_BURST_WAIT_S instead."""

from __future__ import annotations

import pytest

from schemas.events import RequestFailed, RunFinished, RunStarted, TokensGenerated, Usage
from stages.edge.admission import AdmissionConfig, AdmissionGate
from stages.edge.errors import RequestError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finished(rid: str, prompt_tokens: int, prefill_s: float, cached: int = 0) -> RunFinished:
    return RunFinished(
        request_id=rid,
        finish_reason="length",
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=4, cached_tokens=cached),
        prefill_ns=int(prefill_s * 1e9),
    )


def steady(**kw) -> AdmissionConfig:
    """A gate held to max_wait_s whether or not it refused lately (no burst allowance)."""
    kw.setdefault("max_wait_s", AdmissionConfig.max_wait_s)
    return AdmissionConfig(burst_wait_s=kw["max_wait_s"], **kw)


def first_token(rid: str) -> RunStarted:
    """What a live watch sees of a run's first token: the engine's `started` (its `tokens` only
    with logprobs)."""
    return RunStarted(request_id=rid)


def test_a_lone_request_is_admitted_however_long_its_prefill():
    gate = AdmissionGate(steady(max_wait_s=0.5, prefill_tok_s=100))
    gate.admit("big", 50_000)  # 500 s of prefill, but nothing waits ahead of it
    assert set(gate.waiting) == {"big"}


def test_the_prefill_rate_is_learned_from_finished_runs_without_their_cached_tokens():
    gate = AdmissionGate(steady(prefill_tok_s=100))
    gate.observe(finished("a", prompt_tokens=1200, prefill_s=1.0, cached=200))
    assert gate.prefill_tok_s == pytest.approx(1000.0)  # the first sample replaces the guess
    gate.observe(finished("b", prompt_tokens=500, prefill_s=1.0))
    assert gate.prefill_tok_s == pytest.approx(1000.0 + 0.2 * (500.0 - 1000.0))
    gate.observe(finished("c", prompt_tokens=64, prefill_s=0.0))  # no prefill time: no sample
    assert gate.num_prefill_samples == 2


def test_the_engines_compute_rate_replaces_the_runs_own_prefill_times():
    """Runs whose 40-token prompts shared their steps with 31 decoding rows finish with ~0.16 s
    of prefill each (250 tokens/s); the engine's steps say it computes 800 tokens/s. Six runs
    waiting ahead: 0.96 s by the runs' own measure (refused), 0.30 s by the engine's."""
    gate = AdmissionGate(steady(max_wait_s=0.5))
    for i in range(5):
        gate.observe(finished(f"done{i}", prompt_tokens=40, prefill_s=0.16))
    assert gate.prefill_rate == pytest.approx(250.0)
    for i in range(6):
        gate.join(f"ahead{i}", 40)
    assert gate.estimate(40).queue_s == pytest.approx(0.96)
    with pytest.raises(RequestError, match=r"6 requests wait for a first token \(~0\.96 s"):
        gate.admit("new", 40)
    gate.observe(RunStarted(request_id="other", compute_tok_s=800.0))
    assert gate.prefill_rate == 800.0 and gate.prefill_tok_s == pytest.approx(250.0)
    found = gate.estimate(40)
    assert (found.queue_s, found.prefill_s) == (pytest.approx(0.3), pytest.approx(0.05))
    gate.admit("new", 40)
    gate.observe(finished("done5", prompt_tokens=40, prefill_s=0.16))  # no rate: still 800
    assert gate.prefill_rate == 800.0


def test_waiting_prompts_at_the_prefill_rate_bound_the_wait():
    gate = AdmissionGate(steady(max_wait_s=0.5))
    gate.observe(finished("done", prompt_tokens=1000, prefill_s=1.0))  # 1000 tok/s
    gate.admit("a", 300)
    estimate = gate.estimate(150)
    assert (estimate.num_ahead, estimate.queue_s, estimate.prefill_s) == (1, 0.3, 0.15)
    gate.admit("b", 150)  # 0.3 + 0.15 <= 0.5
    with pytest.raises(RequestError) as info:
        gate.admit("c", 100)  # 0.45 + 0.1 > 0.5
    err = info.value
    assert (err.code, err.status) == ("overloaded", 503)
    assert err.retry_after_s == pytest.approx(0.45)
    assert "2 requests wait for a first token (~0.45 s" in err.message
    assert "bound for interactive work is 0.50 s (BRIGADE_EDGE_MAX_WAIT_S)" in err.message
    assert set(gate.waiting) == {"a", "b"}  # a refusal holds nothing


def test_refusals_are_told_to_come_back_one_prefill_apart():
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5), clock=clock)
    gate.observe(finished("done", prompt_tokens=1000, prefill_s=1.0))  # 1000 tok/s
    gate.admit("a", 300)
    gate.admit("b", 150)  # 0.45 s of prompts wait
    retries = []
    for rid, tokens in (("c", 100), ("d", 200), ("e", 100)):
        with pytest.raises(RequestError) as info:
            gate.admit(rid, tokens)
        retries.append(info.value.retry_after_s)
    # when a and b have started, then after c's 0.1 s and d's 0.2 s of prefill
    assert retries == pytest.approx([0.45, 0.55, 0.75])
    clock.now += 0.05
    with pytest.raises(RequestError) as info:
        gate.admit("f", 100)
    assert info.value.retry_after_s == pytest.approx(0.85 - 0.05)  # after e's 0.1 s
    clock.now += 2.0  # the promised times are past: back to the queue's own time
    with pytest.raises(RequestError) as info:
        gate.admit("g", 100)
    assert info.value.retry_after_s == pytest.approx(0.45)


def test_a_line_of_refusals_longer_than_the_spread_starts_over_at_the_queues_time():
    """Under a sustained overload refusals outrun what comes back; past `retry_spread_s` beyond
    the queue's time the retry times start over there, not minutes ahead (an open loop at 2.5x
    capacity was told 32-65 s before the bound)."""
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5, retry_spread_s=0.25), clock=clock)
    gate.observe(finished("done", prompt_tokens=1000, prefill_s=1.0))  # 1000 tok/s
    gate.admit("a", 300)
    gate.admit("b", 150)  # 0.45 s of prompts wait
    retries = []
    for i in range(6):
        with pytest.raises(RequestError) as info:
            gate.admit(f"r{i}", 100)  # 0.1 s of prefill each
        retries.append(info.value.retry_after_s)
    assert retries == pytest.approx([0.45, 0.55, 0.65, 0.45, 0.55, 0.65])


def test_refusals_are_spaced_by_the_start_rate_where_starts_are_slower_than_prefill():
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5, prefill_tok_s=1e6), clock=clock)
    started_one_by_one(gate, clock, 11, 0.1)  # 10 per second of waiting: slots, not prefill
    for i in range(5):
        gate.admit(f"w{i}", 10)  # 5 ahead at 10/s: 0.5 s, over the bound with any prefill
    retries = []
    for i in range(3):
        with pytest.raises(RequestError) as info:
            gate.admit(f"late{i}", 10)
        retries.append(info.value.retry_after_s)
    assert retries == pytest.approx([0.5, 0.6, 0.7], rel=1e-3)  # a start apart, not 10 us


def test_a_requests_later_runs_join_without_a_check_and_count_for_others():
    gate = AdmissionGate(steady(max_wait_s=0.5))
    gate.observe(finished("done", prompt_tokens=1000, prefill_s=1.0))  # 1000 tok/s
    gate.admit("r-0", 400)
    gate.join("r-1", 400)  # 0.4 + 0.4 > 0.5, but the same request's: joins
    assert set(gate.waiting) == {"r-0", "r-1"}
    with pytest.raises(RequestError):
        gate.admit("other", 10)  # another request waits behind both
    gate.release("r-1")
    assert set(gate.waiting) == {"r-0"}


def started_one_by_one(gate: AdmissionGate, clock: Clock, n: int, wait_s: float) -> None:
    """n runs, each waiting `wait_s` alone for its first token: the engine starts 1/wait_s."""
    for i in range(n):
        gate.admit(f"s{i}", 10)
        clock.now += wait_s
        gate.observe(first_token(f"s{i}"))


def test_the_start_rate_bounds_the_wait_and_retry_after_grows_with_the_queue():
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5, prefill_tok_s=1e6), clock=clock)
    started_one_by_one(gate, clock, 11, 0.1)  # 10 per second of waiting
    assert gate.start_rate() == pytest.approx(10.0)
    for i in range(4):
        gate.admit(f"w{i}", 10)  # 4 ahead -> 0.4 s
    with pytest.raises(RequestError) as shallow:
        gate.admit("w4", 10)
        gate.admit("w5", 10)  # 5 ahead at 10/s: 0.5 s, over the bound with its own prefill
    assert shallow.value.retry_after_s == pytest.approx(0.5, rel=1e-3)
    deep = AdmissionGate(steady(max_wait_s=5.0, prefill_tok_s=1e6), clock=clock)
    started_one_by_one(deep, clock, 11, 0.1)
    for i in range(50):
        deep.admit(f"d{i}", 10)
    with pytest.raises(RequestError) as longer:
        deep.admit("d50", 10)
    assert longer.value.retry_after_s == pytest.approx(5.0, rel=1e-3)  # 50 ahead at 10/s


def test_idle_time_between_requests_is_not_the_engines_pace():
    """Clients that come one a second to an engine that starts each in 50 ms: a burst after that
    is estimated at 20 starts per second, not at the clients' one per second."""
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5, prefill_tok_s=1e6), clock=clock)
    for i in range(6):
        gate.admit(f"s{i}", 10)
        clock.now += 0.05
        gate.observe(first_token(f"s{i}"))
        clock.now += 0.95  # nothing waits
    assert gate.start_rate() == pytest.approx(20.0)
    for i in range(8):
        gate.admit(f"b{i}", 10)  # 8 ahead at 20/s: 0.4 s, admitted
    assert gate.estimate(10).queue_s == pytest.approx(0.4)


def test_starts_that_never_had_to_wait_measure_nothing():
    clock = Clock()
    gate = AdmissionGate(steady(prefill_tok_s=1e6), clock=clock)
    for i in range(5):
        gate.admit(f"s{i}", 10)
        gate.observe(first_token(f"s{i}"))  # started at once
        clock.now += 1.0
    assert gate.start_rate() is None


def test_the_start_rate_falls_when_first_tokens_stop_coming():
    clock = Clock()
    gate = AdmissionGate(steady(window_s=10.0), clock=clock)
    started_one_by_one(gate, clock, 5, 0.1)
    fast = gate.start_rate()
    gate.admit("stuck", 10)
    clock.now += 5.0  # a stalled engine: a run waits 5 s and nothing starts
    assert fast is not None and gate.start_rate() < fast / 5
    gate.release("stuck")
    clock.now += 20.0  # past the window: nothing measured
    assert gate.start_rate() is None


def test_batch_gets_only_its_share_of_the_wait():
    gate = AdmissionGate(steady(max_wait_s=1.0, batch_share=0.5, prefill_tok_s=100))
    gate.admit("i", 40)  # 0.4 s ahead
    with pytest.raises(RequestError, match="bound for batch work is 0.50 s"):
        gate.admit("b", 20, "batch")  # 0.4 + 0.2 > 0.5
    gate.admit("i2", 20, "interactive")  # 0.4 + 0.2 <= 1.0


def test_kv_watermark_with_a_queue_refuses():
    gate = AdmissionGate(steady(kv_watermark=0.9))
    gate.observe(
        TokensGenerated(request_id="x", seq=3, token_ids=[1], kv_usage=0.95, num_waiting=0)
    )
    gate.admit("a", 1)  # nothing queued: the engine takes it when blocks free up
    gate.observe(RunStarted(request_id="y", kv_usage=0.95, num_waiting=2))
    with pytest.raises(RequestError, match="KV cache at 95% .* with 2 requests queued"):
        gate.admit("b", 1)


def test_a_wait_ends_at_the_first_token_or_the_runs_end():
    gate = AdmissionGate(steady())
    gate.admit("a", 10)
    gate.admit("b", 10)
    gate.observe(first_token("a"))
    gate.observe(RequestFailed(request_id="b", stage="auth", code="unauthorized", message="x"))
    assert gate.waiting == {} and len(gate.starts) == 1  # a failure is no start


def test_config_is_validated():
    with pytest.raises(ValueError, match="kv_watermark=1.5"):
        AdmissionConfig(kv_watermark=1.5)
    with pytest.raises(ValueError, match="max_wait_s=0"):
        AdmissionConfig(max_wait_s=0)
    with pytest.raises(ValueError, match="retry_spread_s must be > 0"):
        AdmissionConfig(retry_spread_s=0)
    with pytest.raises(ValueError, match="burst_wait_s=0"):
        AdmissionConfig(burst_wait_s=0)


def test_a_burst_into_a_quiet_gate_waits_up_to_the_burst_bound_until_its_first_refusal():
    """Nothing refused lately: a burst is let wait up to burst_wait_s (1 s at 1000 tokens/s is
    ten 100-token prompts); the eleventh is refused, and from then on the gate holds to
    max_wait_s until it has refused nothing for quiet_s."""
    clock = Clock()
    gate = AdmissionGate(AdmissionConfig(max_wait_s=0.5, prefill_tok_s=1000), clock=clock)
    assert gate.bound() == (1.0, "BRIGADE_EDGE_BURST_WAIT_S, nothing refused lately")
    for i in range(10):  # the tenth's estimate: 0.9 s ahead + 0.1 s its own
        gate.admit(f"r{i}", 100)
    with pytest.raises(RequestError, match=r"1\.00 s \(BRIGADE_EDGE_BURST_WAIT_S") as info:
        gate.admit("r10", 100)
    assert info.value.retry_after_s == pytest.approx(1.0)
    assert gate.bound() == (0.5, "BRIGADE_EDGE_MAX_WAIT_S")
    for i in range(10):
        gate.observe(first_token(f"r{i}"))
    gate.admit("a", 100)
    gate.admit("b", 100)
    clock.now += 9.9
    with pytest.raises(RequestError, match=r"0\.50 s \(BRIGADE_EDGE_MAX_WAIT_S\)"):
        gate.admit("c", 400)  # 0.2 + 0.4 > 0.5: refused again, which starts the quiet over
    clock.now += 9.9
    assert gate.bound("batch") == (0.25, "BRIGADE_EDGE_MAX_WAIT_S")
    clock.now += 0.1
    assert gate.bound("batch") == (0.5, "BRIGADE_EDGE_BURST_WAIT_S, nothing refused lately")
    gate.admit("c", 400)


def test_the_kv_watermark_refusal_ends_the_quiet_too():
    gate = AdmissionGate(AdmissionConfig(kv_watermark=0.9))
    gate.observe(RunStarted(request_id="x", kv_usage=0.95, num_waiting=2))
    with pytest.raises(RequestError, match="KV cache at 95%"):
        gate.admit("a", 10)
    assert not gate.quiet


def test_a_burst_bound_below_the_steady_one_changes_nothing():
    gate = AdmissionGate(AdmissionConfig(max_wait_s=2.0, burst_wait_s=1.0))
    assert gate.bound() == (2.0, "BRIGADE_EDGE_MAX_WAIT_S")
    assert gate.bound(placed=True) == (2.0, "BRIGADE_EDGE_MAX_WAIT_S")


def test_quiet_s_zero_leaves_the_burst_bound_to_requests_back_at_their_place():
    gate = AdmissionGate(AdmissionConfig(quiet_s=0.0))
    assert not gate.quiet
    assert gate.bound() == (0.5, "BRIGADE_EDGE_MAX_WAIT_S")
    assert gate.bound("batch", placed=True) == (
        0.5, "BRIGADE_EDGE_BURST_WAIT_S, back at its retry time")  # fmt: skip


def test_what_first_tokens_take_beyond_the_estimate_is_learned_and_counted():
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5, prefill_tok_s=1000), clock=clock)
    for i in range(30):  # each run estimated at 0.1 s of prefill waits 0.6 s for its first token
        gate.admit(f"r{i}", 100)
        clock.now += 0.6
        gate.observe(first_token(f"r{i}"))
        clock.now += 10.0  # no start rate: one start per window
    assert gate.overhead_s == pytest.approx(0.5, abs=0.01)
    gate.admit("a", 100)  # alone: admitted
    with pytest.raises(RequestError, match=r"needs ~0\.60 s more to its first token"):
        gate.admit("b", 100)  # 0.1 ahead + 0.1 + 0.5 > 0.5, though the prompts alone fit


def test_first_tokens_of_one_step_learn_no_overhead_from_each_others_prefill():
    """Three 100-token prompts at 1000 tokens/s, admitted at once (estimated 0.1, 0.2 and
    0.3 s), start together 0.35 s later in one step: the first two also waited for the
    prompts admitted after them (0.2 and 0.1 s), which their estimates rightly did not count.
    Once that is taken off, the first (nothing ahead) was 0.05 s beyond its own prefill: the
    overhead. The second's queue of 0.1 s took 0.125 s beyond that overhead, the third's 0.2 s
    took 0.225 s: 0.35 s for 0.3 s of queues, the queue's factor, learned when the step's first
    tokens are all in."""
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=1.0), clock=clock)
    gate.observe(TokensGenerated(request_id="x", seq=9, token_ids=[1], compute_tok_s=1000.0))
    for rid in "abc":
        gate.admit(rid, 100)
    assert [w.estimate_s for w in gate.waiting.values()] == pytest.approx([0.1, 0.2, 0.3])
    clock.now += 0.35
    for rid in "abc":
        gate.observe(first_token(rid))
    assert (gate.overhead_s, gate.queue_factor) == (0.0, 1.0)  # the step may not be all in yet
    clock.now += 0.011
    found = gate.estimate(100)
    assert found.overhead_s == pytest.approx(0.5 * 0.05)  # one sample, weighing half (up fast)
    assert gate.queue_factor == pytest.approx(1 + 0.5 * (0.35 / 0.3 - 1))  # up fast: halfway
    gate.admit("d", 100)  # alone: its 0.1 s of prefill, 0.1 s beyond it, learned on its own
    clock.now += 0.2
    gate.observe(first_token("d"))
    clock.now += 0.011
    assert gate.estimate(100).overhead_s == pytest.approx(0.025 + 0.5 * (0.1 - 0.025))


def test_a_slow_burst_teaches_the_queue_factor_not_the_overhead():
    """A burst of ten 30-token prompts, estimated at 0.03 s each, starts one by one ~0.1 s
    apart. Only the first waited with nothing ahead: the overhead is its 0.06 s beyond its
    prefill, weighing half. The others' queues took 3.4-4.4x their estimates, learned step by
    step (up fast). Learned as overhead, as it was, that slowness refused every later request
    that found one run ahead, for many seconds; here a request behind one other run is
    admitted, and the third is refused (2 ahead at the start rate the burst showed, 0.2 s,
    times the factor)."""
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5), clock=clock)
    gate.observe(TokensGenerated(request_id="x", seq=9, token_ids=[1], compute_tok_s=1000.0))
    for i in range(10):
        gate.admit(f"b{i}", 30)  # queues of 0 .. 0.27 s, each 0.03 s of its own
    for i in range(10):  # the engine starts them one by one, each a step of its own
        clock.now += 0.09
        gate.observe(first_token(f"b{i}"))
        clock.now += 0.011
    assert gate.overhead_s == pytest.approx(0.03, abs=1e-6)
    assert gate.queue_factor == pytest.approx(3.53, abs=0.01)
    assert gate.start_rate() == pytest.approx(9.9, abs=0.01)
    gate.admit("late0", 30)
    gate.admit("late1", 30)  # 1 ahead: 0.1 s x 3.53 + 0.03 + 0.03 s
    with pytest.raises(RequestError, match="2 requests wait for a first token"):
        gate.admit("late2", 30)


def test_a_refused_request_back_at_its_retry_time_keeps_its_place():
    """The same request (its key) sent again from the retry time it was given is held to the
    burst's bound; early, it is told the same time; past the grace, it is a new request."""
    clock = Clock()
    gate = AdmissionGate(AdmissionConfig(max_wait_s=0.5, prefill_tok_s=1000), clock=clock)
    for i in range(10):
        gate.admit(f"r{i}", 100)  # quiet: up to 1 s
    with pytest.raises(RequestError) as first:
        gate.admit("k1", 100, key="body-1")
    assert first.value.retry_after_s == pytest.approx(1.0)  # the ten ahead started, 1 s on
    with pytest.raises(RequestError) as second:
        gate.admit("k2", 100, key="body-2")
    assert second.value.retry_after_s == pytest.approx(1.1)  # one prefill after the first
    clock.now += 0.5
    with pytest.raises(RequestError) as early:
        gate.admit("k1-early", 100, key="body-1")
    assert early.value.retry_after_s == pytest.approx(0.5)  # the same time, not the line's end
    assert gate._retry_at == pytest.approx(1000.0 + 1.2)  # the line did not grow for it
    clock.now += 0.5
    for i in range(4):
        gate.observe(first_token(f"r{i}"))
    # six runs ahead (0.6 s) and its own 0.1 s: over 0.5, under the burst's 1 s
    assert gate.bound("interactive", placed=True)[1].endswith("back at its retry time")
    gate.admit("k1-back", 100, key="body-1")
    with pytest.raises(RequestError, match=r"0\.50 s \(BRIGADE_EDGE_MAX_WAIT_S\)"):
        gate.admit("k1-again", 100, key="body-1")  # its place was used
    clock.now += 0.1 + 2.0 + 0.01  # body-2's time plus the grace, and a little
    with pytest.raises(RequestError, match="BRIGADE_EDGE_MAX_WAIT_S"):
        gate.admit("k2-late", 100, key="body-2")


def test_a_line_longer_than_the_spread_keeps_no_places():
    clock = Clock()
    gate = AdmissionGate(steady(max_wait_s=0.5, retry_spread_s=0.25, prefill_tok_s=1000),
                         clock=clock)  # fmt: skip
    for i in range(5):
        gate.admit(f"r{i}", 100)
    for i in range(5):  # slots 0.5 s on, one prefill apart: the fourth would be 0.3 s past it
        with pytest.raises(RequestError):
            gate.admit(f"k{i}", 100, key=f"body-{i}")
    # the fourth is told the queue's time with no place; the line starts over behind it
    assert list(gate._promised) == ["body-0", "body-1", "body-2", "body-4"]
    assert list(gate._promised.values()) == pytest.approx([1000.5, 1000.6, 1000.7, 1000.6])
