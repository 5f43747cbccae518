"""What a stage is: `StageSpec` (its name, input, decoder, handler or long-running service, and
delivery settings), validated when built, and the `StageContext` its setup and service get.

A stage module builds one:

    SPEC = StageSpec(
        name="tokenize",                     # durable "brigade-tokenize"; `failed.stage`
        input_event="assembled",             # consumer filter llm.ev.*.assembled
        decoder=decoder_for(ContextAssembled),
        handle=handle,                       # handle(event, state) -> list[Event] (sync or async)
        setup=setup,                         # optional: async setup(ctx: StageContext) -> state
    )

or, for work that outlives one call (the engine), `service=` instead of `handle=`: a
long-running handler (stages/runtime/service.py). stages/runtime/worker.py serves either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas import settings, subjects
from schemas.events import Event, RequestFailed
from stages.runtime.bus import Bus, ConsumerSpec
from stages.runtime.cancels import CancelledRequests
from stages.runtime.service import Service

Handler = Callable[[Any, Any], "list[Event] | Awaitable[list[Event]]"]
ServiceFactory = Callable[["StageContext", Any], Service]  # (ctx, setup's state) -> the service
ReplyFn = Callable[[list[Event]], bytes]
InvalidFn = Callable[
    [bytes, Exception, Any], "RequestFailed | None | Awaitable[RequestFailed | None]"
]


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """What a stage is: its name, its input, its decoder, its handler (`handle`, one call per
    input, or `service`, a long-running handler) and delivery settings."""

    name: str
    input_event: str | tuple[str, ...] | None = None  # tag(s); None with `subject` (the gateway)
    decoder: msgspec.json.Decoder | None = None  # required with an input
    # (decoded input, the message's headers) -> the input the handler gets, for what travels
    # beside the body (the gateway: the API key); may raise msgspec.ValidationError as decoding.
    with_headers: Callable[[Any, Mapping[str, str]], Any] | None = None
    handle: Handler | None = None
    service: ServiceFactory | None = None
    setup: Callable[[StageContext], Awaitable[Any]] | None = None
    teardown: Callable[[Any], Awaitable[None]] | None = None
    subject: str | tuple[str, ...] | None = (
        None  # filter(s) over the stream, for an input not one event
    )
    # A routed input (schemas/subjects.py ROUTED_EVENTS): only the events routed to this token
    # (the engine's model) reach this stage, through a durable of its own.
    route: str | None = None
    stream: str = subjects.EVENTS_STREAM
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: tuple[float, ...] = ()
    max_in_flight: int = 32
    max_hold_s: float = 600.0  # in-progress acks stop after this: a hung handler is redelivered
    drain_s: float = 30.0  # on stop: how long held inputs may finish before they are handed back
    skip_cancelled: bool = True
    # True: a handler exception (not a StageError) naks the input for redelivery instead of
    # failing the request — for stages whose errors are transient (the ledger's file lock).
    retry_errors: bool = False
    # False for a consumer that only records what passes (the run-state projection): an input
    # it cannot handle is a dead letter, never a `failed` event for a run that is fine.
    fails_requests: bool = True
    # Invalid input (raw bytes, the decode error, setup's state) -> the failed event to publish
    # (None: log and ack), sync or async. Default: read the request id and tenant from the JSON.
    on_invalid: InvalidFn | None = None
    # When the input carries a reply header, send reply(outputs) there after publishing.
    reply: ReplyFn | None = None

    def __post_init__(self) -> None:
        if (self.handle is None) == (self.service is None):
            raise ValueError(
                f"stage {self.name!r}: give exactly one of handle= (one call per input) or "
                "service= (a long-running handler)"
            )
        if self.has_input and self.decoder is None:
            raise ValueError(f"stage {self.name!r} has an input but no decoder=")
        if not self.has_input and self.handle is not None:
            raise ValueError(
                f"stage {self.name!r} has no input (input_event and subject are None), so its "
                "handle would never be called; a stage without input is a service="
            )
        if self.drain_s < 0 or self.max_in_flight < 1:
            raise ValueError(
                f"stage {self.name!r}: drain_s={self.drain_s} must be >= 0 and "
                f"max_in_flight={self.max_in_flight} >= 1"
            )

    @property
    def has_input(self) -> bool:
        return self.input_event is not None or self.subject is not None

    def consumer(self) -> ConsumerSpec:
        if self.subject is not None:
            subject: str | tuple[str, ...] = self.subject
        elif isinstance(self.input_event, tuple):
            subject = tuple(subjects.all_events(e) for e in self.input_event)
        else:
            subject = subjects.all_events(self.input_event or "", self.route)
        return ConsumerSpec(
            durable=subjects.durable_name(self.name, self.route),
            filter_subject=subject,
            stream=self.stream,
            ack_wait_s=self.ack_wait_s,
            max_deliver=self.max_deliver,
            backoff_s=self.backoff_s,
            max_ack_pending=max(1024, self.max_in_flight * 8),
            deliver_all=self.stream == subjects.SUBMIT_STREAM,
        )


def _nothing() -> None:
    return None


@dataclass(kw_only=True)
class StageContext:
    """What `setup` and `service` get: the bus, the spec, the cancel set, and `room_changed`,
    which a service calls when its capacity() may have grown (the pull asks for more at once)."""

    bus: Bus
    spec: StageSpec
    cancels: CancelledRequests = field(default_factory=CancelledRequests)
    room_changed: Callable[[], None] = _nothing


def with_env_overrides(spec: StageSpec) -> StageSpec:
    """Operators (and tests) may shorten or lengthen redelivery for every stage at once."""
    found = settings.load()
    changes: dict[str, Any] = {}
    for setting, name in (
        (settings.ACK_WAIT_S, "ack_wait_s"),
        (settings.MAX_DELIVER, "max_deliver"),
    ):
        if found[setting] is not None:
            changes[name] = found[setting]
    return dataclasses.replace(spec, **changes) if changes else spec
