"""`brigade ask "question"`: one request through the running pipeline, streamed to the terminal,
then TTFT, tok/s and the request's per-stage times from its events."""

from __future__ import annotations

import signal
import sys
import time
import uuid


def register(subparsers) -> None:
    p = subparsers.add_parser("ask", help="ask the running pipeline one question, streamed")
    p.add_argument("question", help="the user message")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, help="fixed seed (the run's seed is printed either way)")
    p.add_argument("--model", help="a served model's id (default: the default model)")
    p.add_argument("--system", help="system prompt (default: the model's own)")
    p.add_argument("--api-key", help="default: $BRIGADE_API_KEY or the dev key of brigade up")
    p.add_argument("--nats-url", help="default: $NATS_URL or the NATS of the running brigade up")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")
    p.set_defaults(func=run)


class Answer:
    """The run's events as they arrive: text released in seq order, each delta once."""

    def __init__(self, out=sys.stdout) -> None:
        from stages.edge.reorder import ReorderBuffer

        self.out = out
        self.texts = ReorderBuffer[str]()
        self.events: list = []
        self.terminal = None
        self.first_text_ns: int | None = None
        self.end_ns: int | None = None

    def add(self, event, received_ns: int) -> None:
        from schemas.events import RequestFailed, RunCancelled, RunCompleted, TextGenerated

        self.events.append(event)
        if isinstance(event, TextGenerated):
            for text in self.texts.push(event.seq, event.text):
                if text and self.first_text_ns is None:
                    self.first_text_ns = received_ns
                self.out.write(text)
                self.out.flush()
        elif isinstance(event, RunCompleted | RunCancelled | RequestFailed) and not self.terminal:
            self.terminal = event
            self.end_ns = received_ns

    @property
    def done(self) -> bool:
        """The terminal event arrived and, for a completed run, every text up to its last_seq."""
        last = getattr(self.terminal, "last_seq", None)
        return self.terminal is not None and (last is None or self.texts.next_seq > last)


def stage_times_ms(events) -> dict[str, float]:
    """Each stage's own service time for this request, from the events it published."""
    by_type = {
        "accepted": "gateway",
        "authorized": "auth",
        "assembled": "context",
        "tokenized": "tokenize",
        "text": "detokenize",
        "billed": "ledger",
    }
    out: dict[str, float] = {}
    for e in events:
        tag = type(e).__struct_config__.tag
        if tag in by_type:
            name = by_type[tag]
            out[name] = out.get(name, 0.0) + e.service_ns / 1e6
        elif tag == "finished":
            out["engine queue"] = e.queue_ns / 1e6
            out["engine prefill"] = e.prefill_ns / 1e6
            out["engine decode"] = e.decode_ns / 1e6
    return out


async def ask(args, config, api_key: str | None, out=sys.stdout) -> tuple[Answer, int]:
    import anyio
    import msgspec

    from schemas import subjects
    from schemas.events import CancelRequested, Message, Submit, decode_event
    from stages.runtime.bus import Bus, publish_submit

    request_id = uuid.uuid4().hex
    submit = Submit(
        request_id=request_id,
        api_key=api_key,
        model=args.model,
        messages=[Message(role="user", content=args.question)],
        system=args.system,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    bus = await Bus.connect(config, name="brigade-ask")
    answer = Answer(out)
    try:
        sub = await bus.nc.subscribe(subjects.request_events(request_id))  # before submitting
        await bus.nc.flush()
        sent_ns = time.time_ns()
        await publish_submit(bus.js, submit)  # its key in a header, never in the queued body

        async def cancel_on_ctrl_c(scope) -> None:
            with anyio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    print("\n[cancelling]", file=sys.stderr)
                    await bus.publish(CancelRequested(request_id=request_id, reason="client"))
                    scope.deadline = min(scope.deadline, anyio.current_time() + 10)
                    return

        with anyio.fail_after(args.timeout) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_ctrl_c, scope)
                while not answer.done:
                    msg = await sub.next_msg(timeout=args.timeout)
                    try:
                        answer.add(decode_event(msg.data), time.time_ns())
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                tg.cancel_scope.cancel()
        # The ledger bills right after; its time belongs in the table when it is quick.
        with anyio.move_on_after(0.5):
            while not any(type(e).__struct_config__.tag == "billed" for e in answer.events):
                answer.add(decode_event((await sub.next_msg(timeout=0.5)).data), time.time_ns())
        await sub.unsubscribe()
        return answer, sent_ns
    finally:
        await bus.close()


def report(answer: Answer, sent_ns: int) -> str:
    from schemas.events import RequestFailed, RunCompleted, RunFinished

    t = answer.terminal
    lines = [""]
    if isinstance(t, RequestFailed):
        where = f" (field {t.field})" if t.field else ""
        return f"\nfailed at {t.stage}: {t.code}{where}: {t.message}"
    usage = t.usage
    status = f"{t.finish_reason}" if isinstance(t, RunCompleted) else f"cancelled ({t.reason})"
    lines.append(
        f"-- {status}, {usage.prompt_tokens} prompt + {usage.completion_tokens} output tokens, seed {getattr(t, 'seed', None)}"
    )
    if answer.first_text_ns is not None:
        ttft = (answer.first_text_ns - sent_ns) / 1e6
        span = (answer.end_ns - answer.first_text_ns) / 1e9
        rate = (
            (usage.completion_tokens - 1) / span
            if span > 0 and usage.completion_tokens > 1
            else None
        )
        lines.append(f"   TTFT {ttft:.0f} ms, " + (f"{rate:.1f} tok/s" if rate else "tok/s n/a"))
    models = {e.model for e in answer.events if isinstance(e, RunFinished) and e.model}
    if models:  # the engine that answered says which model it serves
        lines.append(f"   model {', '.join(sorted(models))}")
    times = stage_times_ms(answer.events)
    lines.append("   per stage (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    return "\n".join(lines)


def run(args) -> int:
    import anyio

    from stages.runtime.bus import BusConfig
    from stages.tenancy import tenants

    try:
        config = BusConfig.from_env(args.nats_url)
    except (RuntimeError, ValueError) as err:
        print(f"brigade ask: {err}", file=sys.stderr)
        return 2
    api_key = args.api_key or tenants.dev_key()
    try:
        answer, sent_ns = anyio.run(ask, args, config, api_key)
    except TimeoutError:
        print(
            f"\nbrigade ask: no complete answer within {args.timeout:.0f} s (--timeout); is every stage up? see `brigade status`",
            file=sys.stderr,
        )
        return 1
    print(report(answer, sent_ns), file=sys.stderr)
    return 0 if type(answer.terminal).__struct_config__.tag == "completed" else 1
