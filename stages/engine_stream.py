"""How many tokens the engine stage puts in one `tokens` event: one while the pipeline keeps up,
several while the consumer of those events (detokenize) lags, as vLLM's stream interval does but
chosen from the lag itself.

Every `tokens` event costs the same downstream whatever it carries (a NATS message into the log,
one detokenize call, a `text` event, the edge's two deliveries), so under load fewer, larger
events leave the cores to the engine. The lag is detokenize's durable consumer's backlog
(messages not yet delivered plus delivered but not acked), sampled every `poll_s`. A backlog of
more than one step's events (one per running request) means the events arrive faster than they
are handled: the interval rises to cover it, and falls back by one per sample once it is gone.
`seq` counts events, not steps, so the text, its replay and a failover's continuation are the
same whatever the grouping (tested in tests/stages/test_engine_stream.py).

Off by default (BRIGADE_STREAM_MAX_COALESCE=1): measured side by side with `brigade bench serve
--sides pipeline,pipeline-uncoalesced`, coalescing up to 8 gave 0.83x the aggregate at 8 streams
and 0.91x at 32, with more CPU per token (docs/benchmarks.md, Serving). A lever to try, not a
default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import nats.errors
import nats.js.errors

from schemas import settings, subjects
from stages.runtime.bus import Bus

CONSUMER_STAGE = "detokenize"  # the consumer of `tokens` whose backlog is the lag
log = logging.getLogger("brigade.engine")


@dataclass(frozen=True)
class StreamConfig:
    max_tokens_per_event: int = 1  # 1 (the default): one event per token and step, always
    poll_s: float = 0.1
    # "step": a step's events leave in one socket write once all are published; "event": each
    # as it is published (a write each: measured slower, docs/benchmarks.md)
    flush: str = "step"

    @classmethod
    def from_env(cls) -> StreamConfig:
        found = settings.load()
        return cls(
            found[settings.STREAM_MAX_COALESCE],
            found[settings.STREAM_LAG_POLL_S],
            found[settings.STREAM_FLUSH],
        )


class StreamInterval:
    """The tokens per event allowed now, from the sampled backlog of the events' consumer."""

    def __init__(self, bus: Bus | None, config: StreamConfig) -> None:
        self.bus = bus
        self.config = config
        self.backlog = 0  # the last sample: events not yet handled downstream
        self.interval = 1

    def update(self, backlog: int, num_running: int) -> int:
        """One sample: rise at once to cover a backlog past one step's events, fall by one a
        sample while there is none."""
        self.backlog = backlog
        step_events = max(1, num_running)
        if backlog > step_events:
            wanted = 1 + backlog // step_events
            self.interval = min(self.config.max_tokens_per_event, max(self.interval, wanted))
        elif self.interval > 1:
            self.interval -= 1
        return self.interval

    async def run(self, num_running: Callable[[], int]) -> None:
        """Sample until cancelled (the step loop's task group ends it)."""
        if self.bus is None or self.config.max_tokens_per_event <= 1:
            return
        durable = subjects.durable_name(CONSUMER_STAGE)
        while True:
            await anyio.sleep(self.config.poll_s)
            try:
                info = await self.bus.js.consumer_info(subjects.EVENTS_STREAM, durable)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as err:
                # no detokenize consumer (yet), or the bus is away: no lag to go by
                log.debug("no backlog sample (%s)", type(err).__name__)
                self.update(0, num_running())
                continue
            self.update(int(info.num_pending or 0) + int(info.num_ack_pending or 0), num_running())
