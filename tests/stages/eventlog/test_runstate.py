import dataclasses

import anyio
import pytest

from schemas import subjects
from schemas.events import (
    PromptTokenized,
    Request,
    RequestAccepted,
    RequestFailed,
    RunBilled,
    RunCancelled,
    RunCompleted,
    RunStarted,
    TextGenerated,
    TokensGenerated,
    Usage,
)
from stages.eventlog.runstate import SPEC, IllegalTransition, RunStates, apply, check
from stages.runtime.bus import Bus
from stages.runtime.worker import serve

USAGE = Usage(prompt_tokens=7, completion_tokens=3)


def _accepted(rid: str = "r1") -> RequestAccepted:
    return RequestAccepted(request_id=rid, tenant="acme", request=Request(messages=[]), ts_ns=1)


def test_the_happy_path_and_its_fields():
    rec = apply(None, RequestAccepted(request_id="r1", request=Request(messages=[]), ts_ns=1))
    assert (rec.state, rec.tenant) == ("queued", None)
    rec = apply(rec, _accepted())  # auth's event names the tenant
    assert (rec.state, rec.tenant) == ("queued", "acme")
    rec = apply(rec, PromptTokenized(request_id="r1", prompt_token_ids=[1, 2]))
    assert rec.state == "prefill"
    rec = apply(rec, TokensGenerated(request_id="r1", seq=0, token_ids=[5]))
    assert (rec.state, rec.last_seq) == ("streaming", 0)
    assert apply(rec, TokensGenerated(request_id="r1", seq=1, token_ids=[6])) is None
    rec = apply(rec, RunCompleted(request_id="r1", finish_reason="length", usage=USAGE, last_seq=2))
    assert (rec.state, rec.last_seq, rec.usage, rec.finish_reason) == (
        "completed",
        2,
        USAGE,
        "length",
    )
    rec = apply(rec, RunBilled(request_id="r1", status="completed", usage=USAGE))
    assert rec.state == "billed"
    assert rec.tenant == "acme"


@pytest.mark.parametrize(
    ("current", "new"),
    [("completed", "streaming"), ("cancelled", "completed"), ("billed", "completed"),
     ("streaming", "prefill"), ("prefill", "queued"), (None, "billed"), ("queued", "billed")],
)  # fmt: skip
def test_illegal_transitions_are_refused(current, new):
    with pytest.raises(IllegalTransition, match=f"{current} -> {new}"):
        check(current, new)


def test_billed_before_its_end_passes_through_the_end():
    streaming = apply(None, TokensGenerated(request_id="r1", tenant="acme", seq=0, token_ids=[5]))
    rec = apply(streaming, RunBilled(request_id="r1", status="cancelled", usage=USAGE))
    assert (rec.state, rec.usage, rec.finish_reason) == ("billed", USAGE, "cancelled")
    assert apply(rec, RunCancelled(request_id="r1", usage=USAGE, last_seq=4)) is None


def test_late_events_never_move_a_finished_run():
    done = apply(None, RunCancelled(request_id="r1", usage=USAGE, last_seq=4))
    assert done.state == "cancelled"
    assert apply(done, TextGenerated(request_id="r1", seq=5, text="x")) is None
    assert apply(done, RunCompleted(request_id="r1", finish_reason="stop")) is None
    failed = apply(
        None, RequestFailed(request_id="r2", stage="auth", code="unauthorized", message="no")
    )
    assert (failed.state, failed.error_code) == ("failed", "unauthorized")


@pytest.mark.anyio
async def test_projector_stage_writes_the_kv_record(bus_config):
    """Its durable takes every event a state comes from, the routed `tokenized` too, and no
    `text`; one made by an older release over the whole log is narrowed in place."""
    bus = await Bus.connect(bus_config)
    stop, ready = anyio.Event(), anyio.Event()
    try:
        await bus.ensure_streams()
        old = dataclasses.replace(SPEC.consumer(), filter_subject=subjects.ALL_EVENTS)
        await bus.ensure_consumer(old)
        runs = RunStates(await bus.kv(subjects.RUNS_BUCKET))
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve(SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False)
            )
            await ready.wait()
            for event in [
                _accepted("p1"),
                PromptTokenized(request_id="p1", tenant="acme", prompt_token_ids=[1]),
                RunStarted(request_id="p1", tenant="acme"),
                TokensGenerated(request_id="p1", tenant="acme", seq=0, token_ids=[9]),
                TextGenerated(request_id="p1", tenant="acme", seq=0, text="a"),
            ]:
                await bus.publish(event)
            with anyio.fail_after(10):  # `started`: the run streams
                while (rec := await runs.get("p1")) is None or rec.state != "streaming":
                    await anyio.sleep(0.02)
            for event in [
                TokensGenerated(request_id="p1", tenant="acme", seq=1, token_ids=[9]),
                TextGenerated(request_id="p1", tenant="acme", seq=1, text="b"),
                RunCompleted(
                    request_id="p1", tenant="acme", finish_reason="stop", usage=USAGE, last_seq=1
                ),
                TokensGenerated(request_id="p1", tenant="acme", seq=2, token_ids=[9]),  # late
            ]:
                await bus.publish(event)
            with anyio.fail_after(10):
                while (rec := await runs.get("p1")) is None or rec.state != "completed":
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)  # let the late event through the projector
            rec = await runs.get("p1")
            assert (rec.state, rec.tenant, rec.last_seq, rec.usage) == (
                "completed",
                "acme",
                1,
                USAGE,
            )
            info = await bus.js.consumer_info(subjects.EVENTS_STREAM, SPEC.consumer().durable)
            assert info.delivered.consumer_seq == 4  # the 10 events but their 6 deltas
            assert not {"llm.ev.*.text", "llm.ev.*.tokens"} & set(info.config.filter_subjects)
            assert "llm.ev.*.tokenized.>" in info.config.filter_subjects
            stop.set()
    finally:
        await bus.close()
