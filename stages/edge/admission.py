"""Admission at the edge: the work waiting for a first token is bounded by the time it will take,
and a request past the bound is refused at once (503 `overloaded`, Retry-After from the queue).

Waiting work is the runs this edge submitted that have no first token yet. A new request's time
to its first token is estimated as the time the runs ahead of it need to start (the longer of
their prompts at the prefill rate and their number at the start rate: first tokens per second
of the time runs spent waiting over the last `window_s`, since idle time is the clients' pace,
not the engine's; times what such queues took lately against that estimate), plus its own
prompt at the prefill rate, plus what a first token takes beyond its own prefill (the hops, the engine's step
time). Both are learned one engine step's first tokens at a time: the prompts a step prefills
start together, so each also waited for those admitted after it, which its estimate did not
count; that prefill is neither. The overhead is learned only from runs that waited with nothing
ahead, the queue's factor from the others: a burst's queue that took 3x its estimate says
nothing about a lone request's wait (learned as overhead, it refused every request that found
one run ahead of it for many seconds after the burst).

The prefill rate is the engine's own (`compute_tok_s` on its events: what an added token costs
its step, stages/engine_rate.py); until an engine reports one, the rate of finished runs'
`prefill_ns`, which reads slow under continuous batching (a prompt shares its step with the
decoding rows).

A request is refused when runs wait and the estimate exceeds `max_wait_s` (batch tenants get
`batch_share` of it, so interactive ones keep headroom), or when the engine reports its KV
cache above the watermark with requests queued. A burst into a quiet gate (nothing refused for
`quiet_s`) may wait up to `burst_wait_s` instead: refusing a burst's tail only moves its wait
later (a closed loop's clients come back), while a sustained overload ends the quiet with its
first refusal and is held to `max_wait_s` from then on. A lone request is never refused here:
whether it can ever fit the model's window is the edge's and the context stage's check.

A refusal's retry time is when the work ahead of it will have started, and after the requests
refused before it, each given its own prompt's prefill time: a refused burst comes back at the
rate the engine starts prompts, not all at once. With one retry time for all, a burst of 32
came back together, a few fit and the rest were refused again, round after round (the openai
SDK retries twice by default, honouring `retry-after-ms`).

That time is a place kept: the same request (its tenant and the digest idempotency uses) sent
again from its retry time, within `PROMISE_GRACE_S`, is held to the burst's bound, not the
steady one; sent early, it is told the same time again. Without it a client of a closed loop
was refused six times in a row, each time a little over the bound behind the few runs other
clients had just sent (and admitted whatever the estimate, 32 clients behind 8 slots waited
2.7x longer for first tokens). A line longer than the spread (a standing overload) keeps no
places.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from schemas.events import (
    AnyEvent,
    RequestFailed,
    RunCancelled,
    RunCompleted,
    RunFinished,
    RunStarted,
    TextGenerated,
    TokensGenerated,
)
from stages.edge.errors import RequestError

RATE_WEIGHT = 0.2  # each finished run's share of the learned prefill rate (an EWMA)
# a first token's share of the learned overhead and queue factor: up fast, down slowly (the
# bound is kept for the slow first tokens, not the mean)
OVERHEAD_UP, OVERHEAD_DOWN = 0.5, 0.1
QUEUE_FACTOR_MIN, QUEUE_FACTOR_MAX = 0.5, 4.0
GROUP_S = 0.01  # first tokens this close after a group's first came from one engine step
# a refused request's place is kept this long past the retry time it was given (a client that
# reads only Retry-After's whole seconds comes up to a second late), for at most MAX_PROMISES
PROMISE_GRACE_S, MAX_PROMISES = 2.0, 4096


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    max_wait_s: float = 0.5  # the estimated wait for a first token the edge lets a request take
    kv_watermark: float = 0.95
    batch_share: float = 0.5
    prefill_tok_s: float = 500.0  # the first estimate, until completed runs measure it
    window_s: float = 10.0  # first tokens counted for the start rate
    retry_spread_s: float = 10.0  # refusals' retry times spread this far past the queue's time
    # the bound for a burst into a quiet gate (nothing refused for quiet_s); never below
    # max_wait_s. 1 s is the overload target's first-token P95 (docs/benchmarks.md, Overload)
    burst_wait_s: float = 1.0
    quiet_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s={self.max_wait_s} must be > 0")
        if not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError(f"kv_watermark={self.kv_watermark} must be in (0, 1]")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError(f"batch_share={self.batch_share} must be in (0, 1]")
        if self.prefill_tok_s <= 0 or self.window_s <= 0 or self.retry_spread_s <= 0:
            raise ValueError(f"prefill_tok_s, window_s and retry_spread_s must be > 0, got {self}")
        if self.burst_wait_s <= 0 or self.quiet_s < 0:
            raise ValueError(
                f"burst_wait_s={self.burst_wait_s} must be > 0 and quiet_s={self.quiet_s} >= 0"
            )


@dataclass(frozen=True)
class Waiting:
    prompt_tokens: int
    since: float  # monotonic seconds
    estimate_s: float  # its estimated wait when it was admitted
    order: int = 0  # admitted after every run of a lower order
    queue_model_s: float = 0.0  # its queue's time as estimated at admission, before the factor
    prefill_s: float = 0.0  # its own prompt at the prefill rate


@dataclass(frozen=True)
class Estimate:
    """A new request's expected wait: the runs ahead of it, then its own prefill."""

    num_ahead: int
    queue_s: float  # until the runs ahead have started
    prefill_s: float  # its own prompt
    overhead_s: float = 0.0  # what a first token takes beyond its own prefill, lately
    queue_model_s: float = 0.0  # the queue's time by prefill and start rates, before the factor

    @property
    def total_s(self) -> float:
        return self.queue_s + self.prefill_s + self.overhead_s


class AdmissionGate:
    def __init__(self, config: AdmissionConfig, clock=time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.waiting: dict[str, Waiting] = {}
        # first tokens within window_s: (when, the busy clock then)
        self.starts: deque[tuple[float, float]] = deque()
        self.busy_s = 0.0  # seconds during which some run waited for its first token
        self._ticked = clock()
        self.prefill_tok_s = config.prefill_tok_s  # learned from finished runs' prefill_ns
        self.num_prefill_samples = 0
        self.engine_tok_s: float | None = None  # the engine's own, from its steps
        self.overhead_s = 0.0
        self.queue_factor = 1.0  # what queues took lately against their estimate
        # first tokens of one engine step not yet learned from: (admission order, the run's
        # wait, seconds waited)
        self._group: list[tuple[int, Waiting, float]] = []
        self._order = itertools.count()
        self._group_at = 0.0
        self.kv_usage: float | None = None
        self.engine_waiting: int | None = None
        self._retry_at = 0.0  # the latest retry time given to a refused request
        self._refused_at: float | None = None  # the last refusal, for the burst bound's quiet
        self._promised: OrderedDict[Hashable, float] = OrderedDict()  # a refusal's retry time

    # ---- the estimate ----

    def _tick(self) -> float:
        """Advance the busy clock: it runs only while some run waits for its first token."""
        now = self.clock()
        if self.waiting:
            self.busy_s += now - self._ticked
        self._ticked = now
        return now

    def start_rate(self) -> float | None:
        """First tokens per second of busy time (while runs waited) over the window; None with
        fewer than two, or when none had to wait. Time with nothing waiting does not count: a
        rate measured over idle time is the clients' arrival rate, not what the engine can
        start. It falls when runs wait and starts stop coming."""
        now = self._tick()
        self._forget(now)
        if len(self.starts) < 2:
            return None
        busy = self.busy_s - self.starts[0][1]
        return (len(self.starts) - 1) / busy if busy > 1e-3 else None

    def _slot_start_rate(self) -> float | None:
        """The start rate where it measures the engine: while it reports requests queued for
        its slots, or reports nothing. With none queued, runs start as soon as they arrive and
        are prefilled, and the rate is the clients' (a closed loop of 32 at ~5 starts a second
        counted one run ahead as 0.2 s of queue the engine would have started in one step)."""
        return None if self.engine_waiting == 0 else self.start_rate()

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens per second: the engine's reported compute rate, else (an engine that
        reports none yet) the rate learned from finished runs' own prefill times."""
        return self.engine_tok_s if self.engine_tok_s is not None else self.prefill_tok_s

    def estimate(self, prompt_tokens: int) -> Estimate:
        self._learn_overhead(self.clock())
        ahead = list(self.waiting.values())
        rate = self.prefill_rate
        prefill = prompt_tokens / rate
        if not ahead:
            return Estimate(num_ahead=0, queue_s=0.0, prefill_s=prefill, overhead_s=self.overhead_s)
        by_prefill = sum(w.prompt_tokens for w in ahead) / rate
        starts = self._slot_start_rate()
        by_starts = len(ahead) / starts if starts else 0.0
        queue = max(by_prefill, by_starts)
        return Estimate(
            num_ahead=len(ahead),
            queue_s=queue * self.queue_factor,
            prefill_s=prefill,
            overhead_s=self.overhead_s,
            queue_model_s=queue,
        )

    # ---- admission ----

    @property
    def quiet(self) -> bool:
        """Nothing refused for `quiet_s`: a burst now is not a standing overload. (`quiet_s` 0:
        never quiet, so only a request back at its retry time gets the burst's bound.)"""
        last, quiet_s = self._refused_at, self.config.quiet_s
        return quiet_s > 0 and (last is None or self.clock() - last >= quiet_s)

    def bound(self, priority: str = "interactive", placed: bool = False) -> tuple[float, str]:
        """The wait a request of this priority may take now, and the setting that sets it: the
        burst's bound while the gate is quiet, or for a refused request back at its place."""
        c = self.config
        wait, knob = c.max_wait_s, "BRIGADE_EDGE_MAX_WAIT_S"
        if c.burst_wait_s > wait and placed:
            wait, knob = c.burst_wait_s, "BRIGADE_EDGE_BURST_WAIT_S, back at its retry time"
        elif c.burst_wait_s > wait and self.quiet:
            wait, knob = c.burst_wait_s, "BRIGADE_EDGE_BURST_WAIT_S, nothing refused lately"
        return (wait if priority == "interactive" else wait * c.batch_share), knob

    def admit(
        self,
        request_id: str,
        prompt_tokens: int,
        priority: str = "interactive",
        key: Hashable | None = None,
    ) -> None:
        """Admit or refuse (RequestError `overloaded`). `key` names the request across its
        retries (the same body from the same tenant): a refused one keeps its place."""
        c = self.config
        bound, knob = self.bound(priority, placed=self._place_come(key))
        found = self.estimate(prompt_tokens)
        if found.num_ahead and found.total_s > bound:
            retry = self._retry_after(found, key)
            self._refused_at = self.clock()
            raise RequestError(
                "overloaded",
                f"{found.num_ahead} requests wait for a first token (~{found.queue_s:.2f} s to "
                f"start them) and this one needs ~{found.prefill_s + found.overhead_s:.2f} s "
                f"more to its first token; the bound "
                f"for {priority} work is {bound:.2f} s ({knob}); retry after {retry:.2f} s",
                retry_after_s=retry,
            )
        kv, queued = self.kv_usage, self.engine_waiting
        if kv is not None and kv >= c.kv_watermark and queued:
            self._refused_at = self.clock()
            raise RequestError(
                "overloaded",
                f"engine KV cache at {kv:.0%} (watermark {c.kv_watermark:.0%}, "
                f"BRIGADE_EDGE_KV_WATERMARK) with {queued} requests queued; retry shortly",
                retry_after_s=max(found.queue_s, 1.0),
            )
        if key is not None:
            self._promised.pop(key, None)  # admitted early: its place is not needed
        self._wait(request_id, prompt_tokens, found)

    def _retry_after(self, found: Estimate, key: Hashable | None = None) -> float:
        """Seconds until a refused request should come back: once the runs ahead have started
        (alone then, it is admitted whatever its prefill), and not before the requests refused
        earlier, each of which is given its own prefill's time. That time is kept for `key`."""
        now = self.clock()
        kept = self._promised.get(key) if key is not None else None
        if kept is not None:  # back before its time: the same time again
            return kept - now
        start = now + found.queue_s
        slot = max(start, self._retry_at)
        if slot - start > self.config.retry_spread_s:
            # a line longer than a burst's (refusals past what returns: a sustained overload,
            # clients that give up): spread over the window again instead of minutes ahead,
            # and keep no place (the slots start over, so a place would not be one)
            slot, key = start, None
        starts = self._slot_start_rate()  # where slots, not prefill, bound the starts
        self._retry_at = slot + max(found.prefill_s, 1.0 / starts if starts else 0.0)
        if key is not None:
            self._keep_place(key, slot, now)
        return slot - now

    def _keep_place(self, key: Hashable, at: float, now: float) -> None:
        places = self._promised
        while places and (
            len(places) >= MAX_PROMISES or next(iter(places.values())) + PROMISE_GRACE_S < now
        ):
            places.popitem(last=False)  # the oldest: expired, or one too many
        places[key] = at

    def _place_come(self, key: Hashable | None) -> bool:
        """Whether `key` was refused and told to come back by now (its place is then used up).
        Early, it keeps its place; past the grace, it has lost it."""
        at = self._promised.get(key) if key is not None else None
        if at is None:
            return False
        now = self.clock()
        if now < at:
            return False
        del self._promised[key]
        return now <= at + PROMISE_GRACE_S

    def join(self, request_id: str, prompt_tokens: int) -> None:
        """A later run of a request already admitted (a completions request's further prompts,
        n's further samples): never refused for waiting behind its own first run, but waiting
        work that later requests are estimated against, like any run."""
        self._wait(request_id, prompt_tokens, self.estimate(prompt_tokens))

    def _wait(self, request_id: str, prompt_tokens: int, found: Estimate) -> None:
        self.waiting[request_id] = Waiting(
            prompt_tokens=prompt_tokens,
            since=self._tick(),
            estimate_s=found.total_s,
            order=next(self._order),
            queue_model_s=found.queue_model_s,
            prefill_s=found.prefill_s,
        )

    def release(self, request_id: str) -> None:
        if request_id in self.waiting:
            self._tick()
            del self.waiting[request_id]

    # ---- what the runs tell ----

    def observe(self, event: AnyEvent) -> None:
        """Engine gauges and compute rate, prefill rates of finished runs, and the end of a
        run's wait."""
        if isinstance(event, RunStarted | TokensGenerated | RunFinished):
            if event.kv_usage is not None:
                self.kv_usage = event.kv_usage
            if event.num_waiting is not None:
                self.engine_waiting = event.num_waiting
            if event.compute_tok_s is not None and event.compute_tok_s > 0:
                self.engine_tok_s = event.compute_tok_s
        if isinstance(event, RunFinished):
            self._learn_prefill(event)
        # a run's first token: its `started` (a live watch takes `tokens` only for logprobs)
        first = RunStarted | TokensGenerated | TextGenerated
        if isinstance(event, first) and event.request_id in self.waiting:
            now = self._tick()
            self.starts.append((now, self.busy_s))
            self._forget(now)
            waited = self.waiting[event.request_id]
            self._learn_overhead(now)
            if not self._group:
                self._group_at = now
            self._group.append((waited.order, waited, now - waited.since))
        if isinstance(event, first | RunFinished | RunCompleted | RunCancelled) or isinstance(
            event, RequestFailed
        ):
            self.release(event.request_id)

    def _learn_overhead(self, now: float) -> None:
        """Learn from a group of first tokens once it is over. The prompts one engine step
        prefills start together, so each also waited for those admitted after it, which its
        estimate did not count (they were behind it): that prefill is taken off its wait. A run
        that had nothing ahead teaches the overhead; one that had a queue, the queue's factor."""
        if not self._group or now - self._group_at <= GROUP_S:
            return
        group, self._group = sorted(self._group, key=lambda g: g[0]), []
        later_tokens = 0
        waits = []
        for _, waited, took in reversed(group):
            waits.append((waited, took - later_tokens / self.prefill_rate))
            later_tokens += waited.prompt_tokens
        excess = queued = 0.0  # the queued runs' time beyond prefill and overhead; their queues
        for waited, took in reversed(waits):  # in admission order
            beyond = took - waited.prefill_s  # the queue's time, then the overhead
            if waited.queue_model_s <= 0.0:
                weight = OVERHEAD_UP if beyond > self.overhead_s else OVERHEAD_DOWN
                self.overhead_s = max(0.0, self.overhead_s + weight * (beyond - self.overhead_s))
            else:
                excess += max(0.0, beyond - self.overhead_s)
                queued += waited.queue_model_s
        if queued > 0.0:  # one sample a step, each queue weighing by its length
            factor = min(QUEUE_FACTOR_MAX, max(QUEUE_FACTOR_MIN, excess / queued))
            weight = OVERHEAD_UP if factor > self.queue_factor else OVERHEAD_DOWN
            self.queue_factor += weight * (factor - self.queue_factor)

    def _learn_prefill(self, event: RunFinished) -> None:
        computed = event.usage.prompt_tokens - event.usage.cached_tokens
        if computed <= 0 or event.prefill_ns <= 0:
            return
        rate = computed / (event.prefill_ns / 1e9)
        weight = 1.0 if self.num_prefill_samples == 0 else RATE_WEIGHT
        self.prefill_tok_s += weight * (rate - self.prefill_tok_s)
        self.num_prefill_samples += 1

    def _forget(self, now: float) -> None:
        while self.starts and self.starts[0][0] < now - self.config.window_s:
            self.starts.popleft()
