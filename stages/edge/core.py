"""The edge's core: the client's door (OpenAI-compatible HTTP + SSE, a Realtime-style websocket).

It checks the key against the tenants file for a fast 401/403 (the auth stage stays the
authority), chooses the request id, subscribes to the run's events before it submits, and
delivers text in `seq` order; a client that leaves cancels its run. A tenant only ever sees,
resumes or cancels its own runs; a key never appears in an event, a log line or an error, and
travels to the gateway in a header of the in-memory submit queue, never in a stored body.
The routes (openai_routes, runs, websocket) stand on this module and errors.py; app.py
assembles them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import anyio.abc
import msgspec
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError
from starlette.requests import HTTPConnection

from engine.tokenizer import Tokenizer
from schemas import models, settings, subjects
from schemas.events import (
    AnyEvent,
    CancelRequested,
    Submit,
    TextGenerated,
    decode_event,
    encode,
)
from stages import gateway
from stages.edge.admission import AdmissionConfig, AdmissionGate
from stages.edge.deadline import deadline_for
from stages.edge.errors import BUS_RETRY_AFTER_S, RequestError
from stages.edge.follow import answer_edge_pings, new_edge_worker
from stages.edge.keys import Caller, KeyRing
from stages.edge.logprobs import TokenEvents
from stages.edge.metrics import EdgeMetrics
from stages.edge.runwatch import RunWatch, Waiting, gap_timeout_for
from stages.eventlog.runstate import RunStates
from stages.runtime import heartbeat
from stages.runtime.bus import MSG_ID_HEADER, Bus, publish_submit
from stages.runtime.failures import StageError, bus_unavailable
from stages.tenancy.idempotency import Claim, IdempotencyConflict, IdempotencyStore, request_hash
from stages.tenancy.ratelimit import estimate_prompt_tokens
from stages.tokenize import tokenizer_for

MAX_AUTH_HEADER = 1024
ABANDONED_AFTER_S = 10.0  # a claim with no run in the log this long after: submit it anew
MAX_RUN_MODELS = 100_000  # runs whose model the edge remembers for their metrics' label


@dataclass(frozen=True, kw_only=True)
class EdgeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 1 << 20  # NATS' default max payload: a bigger submit cannot travel
    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 10.0  # connect (or the last response) to the request's headers
    body_timeout_s: float = 30.0  # the headers to the body's last byte
    max_frame_bytes: int = 1 << 20
    idle_timeout_s: float = 300.0  # no event from the pipeline for this long -> 504
    # A client that drops a run with an idempotency key may come back for it: its cancel waits.
    reconnect_grace_s: float = 15.0
    deadline_s: float = 300.0  # a request's wait for its first token unless it or its tenant say
    keepalive_s: float = 10.0  # silence before a waiting stream's keep-alive (deadline.py)
    # an SSE answer's chunks that are ready together go out as one write (else one write each)
    batch_sse: bool = False
    # uvicorn's HTTP/1.1 protocol, httptools or h11 (stages/edge/http_limits.py bounds both)
    http: str = "httptools"
    admission: AdmissionConfig = AdmissionConfig()
    # BRIGADE_MODEL: the served models, `[id=]artifact`, comma-separated, the default first
    model: str = settings.MODEL.default
    # other names accepted in `model` (answered as the id): `alias` (for the default model) or
    # `alias=id`
    model_aliases: tuple[str, ...] = ()
    max_model_len: int | None = None  # None: each model's own context length

    @property
    def served(self) -> tuple[models.ServedModel, ...]:
        return models.parse(self.model)

    def aliases(self) -> dict[str, str]:
        """alias -> the served id it names."""
        default = self.served[0].id
        out = {}
        for entry in self.model_aliases:
            alias, _, target = (part.strip() for part in entry.partition("="))
            out[alias] = target or default
        return out

    @classmethod
    def from_env(cls) -> EdgeConfig:
        found = settings.load()
        return cls(
            host=found[settings.EDGE_HOST],
            port=found[settings.EDGE_PORT],
            max_body_bytes=found[settings.EDGE_MAX_BODY],
            max_header_bytes=found[settings.EDGE_MAX_HEADERS],
            header_timeout_s=found[settings.EDGE_HEADER_TIMEOUT_S],
            body_timeout_s=found[settings.EDGE_BODY_TIMEOUT_S],
            max_frame_bytes=found[settings.EDGE_MAX_FRAME],
            reconnect_grace_s=found[settings.EDGE_RECONNECT_GRACE_S],
            deadline_s=found[settings.EDGE_DEADLINE_S],
            keepalive_s=found[settings.EDGE_KEEPALIVE_S],
            batch_sse=found[settings.EDGE_BATCH_SSE],
            http=found[settings.EDGE_HTTP],
            model=found[settings.MODEL],
            model_aliases=found[settings.EDGE_MODEL_ALIASES],
            max_model_len=found[settings.MAX_MODEL_LEN],
            admission=AdmissionConfig(
                max_wait_s=found[settings.EDGE_MAX_WAIT_S],
                burst_wait_s=found[settings.EDGE_BURST_WAIT_S],
                kv_watermark=found[settings.EDGE_KV_WATERMARK],
            ),
        )


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_headers(conn: HTTPConnection, config: EdgeConfig) -> None:
    raw = conn.scope.get("headers", [])
    size = sum(len(k) + len(v) + 4 for k, v in raw)
    if size > config.max_header_bytes:
        raise RequestError(
            "headers_too_large",
            f"request headers are {size} bytes; at most {config.max_header_bytes} "
            "(BRIGADE_EDGE_MAX_HEADERS) are accepted",
        )


class Edge:
    def __init__(self, bus: Bus, config: EdgeConfig, keys: KeyRing) -> None:
        self.bus, self.config, self.keys = bus, config, keys
        self.metrics = EdgeMetrics([m.id for m in config.served])
        self.tokenizer: Tokenizer | None = None  # the default model's (set by start)
        self.tokenizers: dict[str, Tokenizer] = {}  # every served model's, by id (start)
        # the model each run submitted here is for (its events' metrics label), latest last
        self.run_models: OrderedDict[str, str] = OrderedDict()
        # one gate per model: a model's waiting work and its engines' KV use admit its requests
        self.gates = {m.id: AdmissionGate(config.admission) for m in config.served}
        self.following: Counter[str] = Counter()  # clients following each run here
        self.background: anyio.abc.TaskGroup | None = None  # delayed cancels (set by serve)
        self.idempotency: IdempotencyStore | None = None
        self.runs: RunStates | None = None
        self.edge_worker = new_edge_worker()  # named on every run it submits (follow.py)
        self.pings: Subscription | None = None

    async def start(self) -> None:
        await self.bus.ensure_streams()
        await self.bus.ensure_kv()
        self.pings = await answer_edge_pings(self.bus.nc, self.edge_worker)  # until stop()
        self.idempotency = IdempotencyStore(await self.bus.kv(subjects.IDEMPOTENCY_BUCKET))
        self.runs = RunStates(await self.bus.kv(subjects.RUNS_BUCKET))
        for model in self.config.served:
            self.tokenizers[model.id] = await anyio.to_thread.run_sync(
                tokenizer_for, model.artifact
            )
        self.tokenizer = self.tokenizers[self.config.served[0].id]
        self.metrics = EdgeMetrics([m.id for m in self.config.served], self.max_model_len)

    # ---- the served models ----

    def tokenizer_of(self, model: str | None) -> Tokenizer:
        """The tokenizer of the served model `model` (an id; None: the default)."""
        found = self.tokenizers.get(model) if model is not None else None
        if found is None:
            assert self.tokenizer is not None, "call start() first"
            return self.tokenizer
        return found

    def model_len(self, model: str | None) -> int:
        """A served model's window: BRIGADE_MAX_MODEL_LEN where its own is not smaller."""
        own = self.tokenizer_of(model).max_model_len
        return min(self.config.max_model_len or own, own)

    @property
    def max_model_len(self) -> int:
        """The default model's window."""
        return self.model_len(None)

    def served_model(self, caller: Caller, name: str | None) -> str:
        """The served model's id for `name` (an id or an alias; None: the default), else a
        404 `model_not_found`; a tenant limited to other models gets a 403."""
        config = self.config
        ids = [m.id for m in config.served]
        aliases = config.aliases()
        if name is None:
            model = ids[0]
        elif name in ids:
            model = name
        elif aliases.get(name) in ids:  # an alias of a model not served is no name of one
            model = aliases[name]
        else:
            names = ", ".join((*ids, *(a for a, target in aliases.items() if target in ids)))
            raise RequestError(
                "model_not_found",
                f"the model {name[:100]!r} is not served here; served: {names} "
                "(GET /v1/models; aliases: BRIGADE_EDGE_MODEL_ALIASES)",
                "model",
            )
        if name is not None and name in caller.allowed_models:
            return model
        caller.check_model(model)
        return model

    async def beats(self) -> list[heartbeat.Beat] | None:
        """Every live worker's latest heartbeat (None: the bucket cannot be read now)."""
        try:
            with anyio.fail_after(2.0):
                kv = await self.bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
                return await heartbeat.beats(kv, timeout_s=1.0)
        except Exception:  # noqa: BLE001 - answered without them (/health's detail, /metrics)
            return None

    async def engine_ready(self) -> tuple[bool, str]:
        """Whether every served model has an engine worker serving its durable now: a waiting
        pull request, or work delivered and not yet acked (a full engine asks for no more; a
        dead one's deliveries count until their ack wait ends)."""
        if not self.bus.nc.is_connected:
            return False, "the edge is not connected to NATS"
        said = []
        for model in self.config.served:
            ready, detail = await self._model_ready(model)
            if not ready:
                return False, detail
            said.append(detail)
        return True, "; ".join(said)

    async def _model_ready(self, model: models.ServedModel) -> tuple[bool, str]:
        durable = subjects.durable_name("engine", model.token)
        for attempt in range(3):  # a worker tops its pull up every second: look again briefly
            try:
                info = await self.bus.js.consumer_info(subjects.EVENTS_STREAM, durable)
            except NotFoundError:
                return False, (
                    f"no engine durable {durable!r} yet: no engine worker of {model.id!r} has "
                    "started"
                )
            if info.num_waiting:
                return True, f"{model.id}: {info.num_waiting} engine pull request(s) waiting"
            if info.num_ack_pending:
                return True, f"{model.id}: an engine worker holds {info.num_ack_pending} request(s)"  # fmt: skip
            if attempt < 2:
                await anyio.sleep(0.1)
        return False, f"no engine worker of {model.id!r} is pulling from {durable!r}"

    # ---- identity ----

    def authenticate(self, conn: HTTPConnection) -> Caller:
        check_headers(conn, self.config)
        header = conn.headers.get("authorization")
        if header is None:
            raise RequestError("unauthorized", "missing `Authorization: Bearer <key>` header")
        if len(header) > MAX_AUTH_HEADER:
            raise RequestError(
                "unauthorized", f"Authorization header longer than {MAX_AUTH_HEADER} characters"
            )
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise RequestError("unauthorized", "Authorization must be `Bearer <key>`")
        caller = self.keys.lookup(key.strip())
        if caller is None:
            raise RequestError("unauthorized", "invalid API key")
        return caller

    async def run_tenant(self, request_id: str) -> str | None:
        """The tenant that owns a run, from the log (the `authorized` event), else None."""
        subject = subjects.event_subject(request_id, "authorized")
        try:
            msg = await self.bus.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        if not msg.data:
            return None
        try:
            return decode_event(msg.data).tenant
        except msgspec.DecodeError:  # a poison stored on the subject names no owner
            return None

    async def owned(self, caller: Caller, request_id: str) -> None:
        """404 for a run that does not exist and for another tenant's run alike."""
        if await self.run_tenant(request_id) != caller.tenant:
            raise RequestError("not_found", f"no run {request_id} for this key", "request_id")

    # ---- runs ----

    def _watch(
        self,
        request_id: str,
        starting_after: int | None,
        tokens: TokenEvents | None = None,
        deadline_s: float | None = None,
    ) -> RunWatch:
        def observe(event: AnyEvent, received_ns: int) -> None:
            self._observe(event, received_ns)
            if tokens is not None:
                tokens.observe(event)

        return RunWatch(
            self.bus.nc,
            self.bus.js,
            request_id,
            starting_after=starting_after,
            idle_timeout_s=self.config.idle_timeout_s,
            deadline_s=deadline_s,
            keepalive_s=self.config.keepalive_s,
            gap_timeout_s=gap_timeout_for(self.bus.config.ack_wait_s, self.bus.config.max_deliver),
            on_event=observe,
            with_tokens=tokens is not None,  # logprobs: each text delta's tokens event
        )

    def _observe(self, event: AnyEvent, _received_ns: int) -> None:
        model = getattr(event, "model", None) or self.run_models.get(event.request_id)
        self.metrics.observe_event(event, model)
        self.gate_of(model).observe(event)

    def gate_of(self, model: str | None) -> AdmissionGate:
        """The admission gate of a served model (None, or one not served: the default's)."""
        return self.gates.get(model or "") or next(iter(self.gates.values()))

    def _release(self, request_id: str) -> None:
        """The run no longer waits here, whichever model's it is."""
        for gate in self.gates.values():
            gate.release(request_id)

    def _remember_model(self, request_id: str, model: str) -> None:
        self.run_models[request_id] = model
        self.run_models.move_to_end(request_id)
        while len(self.run_models) > MAX_RUN_MODELS:
            self.run_models.popitem(last=False)

    async def open_run(
        self,
        caller: Caller,
        submit: Submit,
        tokens: TokenEvents | None = None,
        admit: bool = True,
    ) -> RunWatch:
        """Subscribe, then submit; with an idempotency key possibly re-attach to its first run.
        `tokens`, when given, receives the run's `tokens` events (for logprobs). `admit=False`:
        a later run of a request already admitted (further prompts, n's further samples): it
        joins the waiting work without being refused for waiting behind its own first run."""
        model = self.served_model(caller, submit.model)
        submit = msgspec.structs.replace(submit, model=model)
        try:  # the gateway's own checks, here for a fast 400 and the idempotency digest
            request = gateway.normalize(submit, limit_chars=gateway.max_text_chars())
        except StageError as err:
            raise RequestError("invalid_request", err.message, err.field) from None
        request_id = submit.request_id or new_request_id()
        self._remember_model(request_id, model)
        deadline = deadline_for(submit.deadline_s, caller.deadline_s, self.config.deadline_s)
        submit = msgspec.structs.replace(submit, request_id=request_id, deadline_s=deadline,
                                         edge_worker=self.edge_worker)  # fmt: skip
        await self.check_fits(submit)
        digest = request_hash(request)
        if admit:  # a refused request sent again (the same tenant and digest) keeps its place
            self.gate_of(model).admit(
                request_id, prompt_tokens(submit), caller.priority, key=(caller.tenant, digest)
            )
        else:
            self.gate_of(model).join(request_id, prompt_tokens(submit))
        try:
            return await self._submit(caller, submit, digest, request_id, tokens)
        except BaseException as err:
            self._release(request_id)
            if isinstance(err, Exception) and bus_unavailable(err):
                await self._withdraw(caller, request_id)
            raise

    def _bus_up(self) -> None:
        """Refuse (503) before submitting while NATS is away: a submit published into the
        reconnecting client's buffer would run once the bus is back, after its client was told
        it failed."""
        if not self.bus.nc.is_connected:
            raise RequestError(
                "unavailable",
                "the message bus is reconnecting; nothing was submitted, retry shortly",
                retry_after_s=BUS_RETRY_AFTER_S,
            )

    async def _withdraw(self, caller: Caller, request_id: str) -> None:
        """The submit's ack never came (the client gets a 503), yet the bus may store it once it
        is back: its cancel goes into the client's buffer right behind it, so the run ends at its
        first stage instead of running for nobody. Core publish: it waits for no ack."""
        event = CancelRequested(request_id=request_id, tenant=caller.tenant, reason="timeout",
                                ts_ns=time.time_ns())  # fmt: skip
        headers = {MSG_ID_HEADER: subjects.msg_id(request_id, "cancel")}
        with contextlib.suppress(Exception):  # a closed connection: nothing more can reach it
            await self.bus.nc.publish(subjects.event_subject(request_id, "cancel"),
                                      encode(event), headers=headers)  # fmt: skip

    async def check_fits(self, submit: Submit) -> None:
        """A request that can never fit the model's window is a 400 naming the limit, before
        admission, busy or idle: max_tokens alone, or with the text no truncation drops (a raw
        prompt, the last message; not under sliding_window). Near the limit the context stage
        decides, on the real template."""
        limit = self.model_len(submit.model)
        if submit.max_tokens >= limit:
            raise RequestError(
                "context_length",
                f"max_tokens={submit.max_tokens} leaves no room for a prompt in the model's "
                f"{limit}-token context window (BRIGADE_MAX_MODEL_LEN); lower max_tokens",
                "max_tokens",
            )
        if submit.truncation == "sliding_window":
            return
        field, text = (
            ("prompt", submit.prompt)
            if submit.prompt is not None
            else ("messages", submit.messages[-1].content if submit.messages else "")
        )
        if estimate_prompt_tokens([text]) + submit.max_tokens <= limit:
            return
        tokenizer = self.tokenizer_of(submit.model)
        num_tokens = len(await anyio.to_thread.run_sync(tokenizer.encode_text, text))
        if num_tokens + submit.max_tokens > limit:
            what = "the prompt" if field == "prompt" else "the last message"
            raise RequestError(
                "context_length",
                f"{what} has {num_tokens} tokens and max_tokens={submit.max_tokens} more: over "
                f"the model's {limit}-token context window (BRIGADE_MAX_MODEL_LEN), busy or "
                "idle; send less text or lower max_tokens",
                field,
            )

    async def _submit(
        self,
        caller: Caller,
        submit: Submit,
        digest: str,
        request_id: str,
        tokens: TokenEvents | None,
    ) -> RunWatch:
        if submit.idempotency_key is not None:
            assert self.idempotency is not None
            try:
                claim = await self.idempotency.claim(
                    caller.tenant, submit.idempotency_key, digest, request_id
                )
            except IdempotencyConflict as err:
                raise RequestError("conflict", str(err), "idempotency_key") from None
            if not claim.new and await self._abandoned(claim):
                stale = claim.request_id
                if not await self.idempotency.take_over(
                    caller.tenant, submit.idempotency_key, digest, stale, request_id
                ):
                    raise RequestError(
                        "conflict", "the idempotency key changed hands; retry", "idempotency_key"
                    )
                claim = Claim(request_id=request_id, new=True)
            if not claim.new:
                self._release(request_id)
                if tokens is not None:
                    tokens.request_id = claim.request_id
                watch = self._watch(claim.request_id, -1, tokens, submit.deadline_s)
                watch.idempotency_key = submit.idempotency_key
                await watch.start()
                return watch
        watch = self._watch(request_id, None, tokens, submit.deadline_s)
        watch.idempotency_key = submit.idempotency_key
        await watch.start()
        self._bus_up()
        await self.bus.nc.flush()
        await publish_submit(self.bus.js, submit, api_key=caller.api_key)  # the key in a header
        return watch

    async def _abandoned(self, claim: Claim) -> bool:
        """A claimed run that never reached the gateway (its edge died between claim and submit):
        nothing of it in the log after `ABANDONED_AFTER_S`."""
        if claim.age_s < ABANDONED_AFTER_S:
            return False
        for event in ("accepted", "failed"):
            subject = subjects.event_subject(claim.request_id, event)
            try:
                await self.bus.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
                return False
            except NotFoundError:
                continue
        return True

    async def attach(self, caller: Caller, request_id: str, starting_after: int) -> RunWatch:
        await self.owned(caller, request_id)
        watch = self._watch(request_id, starting_after=starting_after)
        await watch.start()
        return watch

    async def cancel(self, caller: Caller, request_id: str, reason: str = "client") -> None:
        event = CancelRequested(request_id=request_id, tenant=caller.tenant, reason=reason)
        with anyio.CancelScope(shield=True):
            await self.bus.publish(event)

    async def stop(self) -> None:
        """Answer no more pings: the sweeper cancels what this edge's clients left behind."""
        if self.pings is not None:
            pings, self.pings = self.pings, None
            with contextlib.suppress(Exception):  # a closed connection ended it already
                await pings.unsubscribe()

    async def left(self, caller: Caller, watch: RunWatch, reason: str = "disconnect") -> None:
        """The client left before the run's end: cancel it, after a grace period when it holds
        an idempotency key (a retry with the key re-attaches and keeps it alive)."""
        if watch.terminal is not None:
            return
        grace = self.config.reconnect_grace_s
        if watch.idempotency_key is None or self.background is None or grace <= 0:
            await self.cancel(caller, watch.request_id, reason)
            return

        async def cancel_unless_followed() -> None:
            await anyio.sleep(grace)
            if self.following[watch.request_id]:
                return  # a retry re-attached here and follows it now
            record = await self.runs.get(watch.request_id) if self.runs is not None else None
            if record is None or record.state not in ("completed", "failed", "cancelled", "billed"):
                await self.cancel(caller, watch.request_id, reason)

        self.background.start_soon(cancel_unless_followed)

    async def deltas(
        self, watch: RunWatch, keepalive: bool = False
    ) -> AsyncIterator[TextGenerated | Waiting]:
        """The run's deltas with the edge's latency metrics (TTFT, ITL, e2e); with `keepalive`,
        a `Waiting` too after each BRIGADE_EDGE_KEEPALIVE_S of silence."""
        started = last = time.monotonic()
        first = True
        series = self.metrics.of(self.run_models.get(watch.request_id))
        series.open_streams.inc()
        self.following[watch.request_id] += 1
        try:
            async for delta in watch.events() if keepalive else watch.deltas():
                if isinstance(delta, Waiting):
                    yield delta
                    continue
                now = time.monotonic()
                (series.ttft if first else series.itl).observe(now - last)
                first, last = False, now
                yield delta
            series.e2e.observe(time.monotonic() - started)
        finally:
            series.open_streams.dec()
            self.following[watch.request_id] -= 1
            if not self.following[watch.request_id]:
                del self.following[watch.request_id]
            self._release(watch.request_id)  # no longer followed here: not waiting work


def prompt_tokens(submit: Submit) -> int:
    """The prompt's tokens before tokenization (an estimate), for admission."""
    texts = [m.content for m in submit.messages or []] + [submit.prompt or "", submit.system or ""]
    return estimate_prompt_tokens([t for t in texts if t]) + len(submit.prompt_token_ids or ())
