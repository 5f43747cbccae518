"""Detokenize with the real SmolLM2 tokenizer: UTF-8 safety, stop strings, out-of-order events."""

from __future__ import annotations

import random

import msgspec
import pytest

from engine.tokenizer import load_tokenizer
from schemas.events import (
    CancelRequested,
    RunCancelled,
    RunCompleted,
    RunFinished,
    TextGenerated,
    TokensGenerated,
    Usage,
)
from stages.detokenize import Detokenizer, context_window, visible

WAVE = [26843, 15107, 235, 229, 10813, 233, 138, 665]  # "Hi 👋🏽 there": emoji bytes over 6 tokens
CJK = [23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226]
STOP_TEXT = [504, 1112, 30, 5022, 7627, 1535]  # "The", " end", ".", " ST", "OP", " here"


@pytest.fixture(scope="module")
def detok() -> Detokenizer:
    return Detokenizer(load_tokenizer("smollm2-135m"))


def run_events(
    ids: list[int],
    *,
    step: int = 1,
    stop: tuple[str, ...] = (),
    finish_reason: str = "length",
    stop_seq: int | None = None,
    cancel_reason: str | None = None,
) -> list[TokensGenerated | RunFinished]:
    """The events an engine publishes for `ids`, `step` tokens per step, context per contract."""
    stop_list = list(stop)
    window = context_window(stop_list)
    events: list[TokensGenerated | RunFinished] = []
    for seq, start in enumerate(range(0, len(ids), step)):
        events.append(
            TokensGenerated(
                request_id="r1",
                tenant="dev",
                seq=seq,
                token_ids=ids[start : start + step],
                context_token_ids=ids[max(0, start - window) : start],
                stop=stop_list,
            )
        )
    last_seq = len(events) - 1 if stop_seq is None else stop_seq
    upto = min(len(ids), (last_seq + 1) * step)
    events.append(
        RunFinished(
            request_id="r1",
            tenant="dev",
            finish_reason=finish_reason,
            usage=Usage(prompt_tokens=5, completion_tokens=upto),
            last_seq=last_seq if ids else None,
            context_token_ids=ids[max(0, upto - window) : upto],
            stop=stop_list,
            seed=7,
            cancel_reason=cancel_reason,
        )
    )
    return events


def texts(detok: Detokenizer, events, *, shuffle_seed: int | None = None):
    order = list(events)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    out = [o for e in order for o in detok.handle(e)]
    text = sorted((o for o in out if isinstance(o, TextGenerated)), key=lambda t: t.seq)
    return [t.text for t in text], out


def test_emoji_split_over_tokens_is_never_cut(detok):
    parts, out = texts(detok, run_events(WAVE))
    assert parts == ["Hi", " ", "", "👋", "", "", "🏽", " there", ""]
    assert "".join(parts) == "Hi 👋🏽 there"
    done = [o for o in out if isinstance(o, RunCompleted)]
    assert done == [
        RunCompleted(
            request_id="r1",
            tenant="dev",
            finish_reason="length",
            usage=Usage(prompt_tokens=5, completion_tokens=8),
            last_seq=8,
            seed=7,
        )
    ]


def test_cjk_one_token_per_event_has_no_replacement_character(detok):
    parts, _ = texts(detok, run_events(CJK))
    assert "".join(parts) == "日本語のテキスト"
    assert all("\ufffd" not in p for p in parts)
    assert parts[:4] == ["", "日", "本", ""]


def test_long_output_with_window_cut_inside_characters(detok):
    ids = CJK * 6 + WAVE  # windows of 8 tokens start inside 3-byte characters many times
    assert context_window([]) == 8
    parts, _ = texts(detok, run_events(ids))
    assert "".join(parts) == "日本語のテキスト" * 6 + "Hi 👋🏽 there"
    assert all("\ufffd" not in p for p in parts)


def test_out_of_order_events_give_the_same_texts(detok):
    events = run_events(CJK * 2 + WAVE, step=3, stop=("テキストHi",))
    in_order, _ = texts(detok, events)
    for seed in range(5):
        shuffled, _ = texts(detok, events, shuffle_seed=seed)
        assert shuffled == in_order
    assert "".join(in_order) == "日本語のテキスト日本語の"


def test_stop_string_across_events_is_cut_and_cancels(detok):
    parts, out = texts(detok, run_events(STOP_TEXT, stop=("STOP",), finish_reason="stop"))
    assert parts == ["The", " end", ".", " ", "", "", ""]
    stopped = [o.seq for o in out if isinstance(o, TextGenerated) and o.stopped]
    assert stopped == [4, 6]  # the event that completed "STOP", and the final flush
    cancels = [o for o in out if isinstance(o, CancelRequested)]
    assert cancels == [CancelRequested(request_id="r1", tenant="dev", reason="stop_string", seq=4)]
    done = [o for o in out if isinstance(o, RunCompleted)]
    assert [(d.finish_reason, d.last_seq) for d in done] == [("stop", 6)]


def test_engine_abort_after_a_stop_string_completes_as_stop(detok):
    events = run_events(
        STOP_TEXT, stop=("STOP",), finish_reason="abort", stop_seq=4, cancel_reason="stop_string"
    )
    parts, out = texts(detok, events)
    assert "".join(parts) == "The end. "
    assert parts[-1] == "" and len(parts) == 7  # seq 0..5 and the flush at last_seq+1 = 5
    done = [o for o in out if isinstance(o, RunCompleted)]
    assert [(d.finish_reason, d.last_seq, d.usage.completion_tokens) for d in done] == [
        ("stop", 5, 5)
    ]


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop(detok):
    parts, out = texts(detok, run_events(STOP_TEXT, stop=("STOPPED",)))
    assert parts == ["The", " end", ".", " ", "", "STOP here", ""]
    assert not any(isinstance(o, CancelRequested) for o in out)


def test_final_flush_releases_held_back_tail_and_stop_on_length_is_length(detok):
    ids = [21350, 42, 216, 36, 34, 198, 198]  # "Answer: 42\n\n"
    parts, out = texts(detok, run_events(ids, step=2, stop=("\n\nQ",)))
    assert parts == ["Answer:", " 4", "2", "", "\n\n"]
    done = [o for o in out if isinstance(o, RunCompleted)]
    assert [(d.finish_reason, d.last_seq) for d in done] == [("length", 4)]


def test_stop_found_in_the_last_event_on_length_reports_stop(detok):
    parts, out = texts(detok, run_events(STOP_TEXT[:5], stop=("STOP",)))
    assert "".join(parts) == "The end. "
    done = [o for o in out if isinstance(o, RunCompleted)]
    assert [d.finish_reason for d in done] == ["stop"]


def test_generation_cut_inside_a_character_flushes_a_replacement(detok):
    parts, _ = texts(detok, run_events([26843, 40303]))
    assert parts == ["Hi", " ", "\ufffd"]


def test_client_cancel_publishes_flush_then_cancelled(detok):
    events = run_events(WAVE[:3], finish_reason="abort", cancel_reason="client")
    parts, out = texts(detok, events)
    assert parts == ["Hi", " ", "", "\ufffd"]
    cancelled = [o for o in out if isinstance(o, RunCancelled)]
    assert cancelled == [
        RunCancelled(
            request_id="r1",
            tenant="dev",
            reason="client",
            usage=Usage(prompt_tokens=5, completion_tokens=3),
            last_seq=3,
        )
    ]
    assert not any(isinstance(o, RunCompleted) for o in out)


def test_no_tokens_at_all_flushes_seq_zero(detok):
    _, out = texts(detok, run_events([], finish_reason="stop"))
    assert [type(o).__name__ for o in out] == ["TextGenerated", "RunCompleted"]
    assert out[0].seq == 0 and out[0].text == "" and out[1].last_seq == 0


def test_a_models_tokenizer_is_looked_up_once_and_a_model_not_served_each_time():
    """The lookup reads the deployment's settings: once a served model, not once a token."""
    tok = load_tokenizer("smollm2-135m")
    asked: list[str] = []

    def for_model(model: str):
        asked.append(model)
        if model != "smollm2-135m":
            raise LookupError(model)
        return tok

    detok = Detokenizer(tok, for_model=for_model)
    events = [msgspec.structs.replace(e, model="smollm2-135m") for e in run_events(WAVE)]
    got, _ = texts(detok, events)
    assert "".join(got) == "Hi 👋🏽 there" and asked == ["smollm2-135m"]
    for _ in range(2):
        with pytest.raises(LookupError):
            detok.handle(msgspec.structs.replace(events[0], model="other"))
    assert asked == ["smollm2-135m", "other", "other"]


def test_visible_cuts_at_the_earliest_stop_and_holds_back_prefixes():
    assert visible("abc END x STOP", ["STOP", "END"], final=False) == ("abc ", True)
    assert visible("abc EN", ["END"], final=False) == ("abc ", False)
    assert visible("abc EN", ["END"], final=True) == ("abc EN", False)
    assert visible("abc", [], final=False) == ("abc", False)


@pytest.mark.anyio
async def test_stage_on_a_real_bus_publishes_texts_cancel_and_completed(bus_config) -> None:
    """Out-of-order `tokens` and `finished` through the served stage: exact outputs, one each."""
    import anyio

    from schemas import subjects
    from schemas.events import decode_event
    from stages import detokenize
    from stages.runtime import worker as runtime
    from stages.runtime.bus import Bus

    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    sub = await bus.nc.subscribe(subjects.request_events("r1"))
    stop, ready = anyio.Event(), anyio.Event()
    events = run_events(STOP_TEXT, stop=("STOP",), finish_reason="stop")
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: runtime.serve(
                detokenize.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        for event in reversed(events):
            await bus.publish(event)
        got: dict[str, list] = {}
        with anyio.fail_after(20):
            while len(got.get("text", [])) < 7 or "completed" not in got:
                event = decode_event((await sub.next_msg(timeout=20)).data)
                got.setdefault(type(event).__struct_config__.tag, []).append(event)
        stop.set()
    await sub.unsubscribe()
    await bus.close()
    texts_by_seq = sorted((t.seq, t.text) for t in got["text"])
    assert texts_by_seq == [(0, "The"), (1, " end"), (2, "."), (3, " "), (4, ""), (5, ""), (6, "")]
    assert [(c.reason, c.seq) for c in got["cancel"]] == [("stop_string", 4)]
    (done,) = got["completed"]
    assert (done.finish_reason, done.last_seq, done.seed) == ("stop", 6, 7)
    assert all(t.service_ns > 0 and t.ts_ns > 0 for t in got["text"])
