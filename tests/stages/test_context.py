"""Context assembly: each truncation strategy with exact token counts under the chat template."""

from __future__ import annotations

import anyio
import pytest

from schemas.events import (
    CancelRequested,
    ContextAssembled,
    Document,
    Message,
    Request,
    RequestAuthorized,
    Sampling,
)
from stages import context, summarize
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.worker import StageError
from stages.tokenize import prompt_token_ids, tokenizer_for


@pytest.fixture(scope="module")
def costs() -> context.Costs:
    return context.Costs(tokenizer_for("smollm2-135m"))


HISTORY = [
    Message(
        role="user" if i % 2 == 0 else "assistant",
        content=f"message number {i} about the weather in Paris",
    )
    for i in range(10)
]


def request(truncation: str, max_tokens: int = 10, **kw) -> Request:
    return Request(
        messages=[*HISTORY, Message(role="user", content="What now?")],
        system="Be brief.",
        documents=[Document(content="Paris is in France.", title="geo")],
        truncation=truncation,
        sampling=Sampling(max_tokens=max_tokens),
        **kw,
    )


def parts(fit: context.Fit) -> list[tuple[str, int, int, int]]:
    return [(p.name, p.num_tokens, p.num_dropped_tokens, p.num_dropped_items) for p in fit.parts]


def true_length(fit: context.Fit, costs: context.Costs) -> int:
    return len(prompt_token_ids(Request(messages=fit.messages), costs.tok))


def test_everything_fits_untouched(costs: context.Costs) -> None:
    fit = context.fit(request("drop_oldest"), costs, 1000)
    assert parts(fit) == [
        ("system", 8, 0, 0),
        ("documents", 16, 0, 0),
        ("history", 145, 0, 0),
        ("user", 8, 0, 0),
        ("template", 4, 0, 0),
    ]
    assert fit.num_prompt_tokens == true_length(fit, costs) == 181 and not fit.truncated
    assert fit.messages[0] == Message(
        role="system", content="Be brief.\n\nDocuments:\n\n[1] geo\nParis is in France."
    )
    assert fit.messages[1:] == [*HISTORY, Message(role="user", content="What now?")]


def test_drop_oldest_drops_whole_messages(costs: context.Costs) -> None:
    fit = context.fit(request("drop_oldest"), costs, 100)
    assert parts(fit)[2] == ("history", 58, 87, 6)
    assert fit.num_prompt_tokens == true_length(fit, costs) == 94
    assert fit.messages[1:-1] == HISTORY[6:] and fit.truncated


def test_sliding_window_cuts_the_boundary_message(costs: context.Costs) -> None:
    fit = context.fit(request("sliding_window"), costs, 60)
    assert parts(fit)[2] == ("history", 24, 121, 8)
    assert fit.num_prompt_tokens == true_length(fit, costs) == 60  # the budget, exactly
    assert fit.messages[1] == Message(role="user", content=" the weather in Paris")
    assert fit.messages[2:-1] == HISTORY[9:]
    drop = context.fit(request("drop_oldest"), costs, 60)
    assert drop.num_prompt_tokens == true_length(drop, costs) == 51  # whole messages only


def test_documents_go_after_all_history_then_context_length(costs: context.Costs) -> None:
    fit = context.fit(request("drop_oldest"), costs, 30)
    assert parts(fit) == [
        ("system", 8, 0, 0),
        ("documents", 0, 16, 1),
        ("history", 0, 145, 10),
        ("user", 8, 0, 0),
        ("template", 4, 0, 0),
    ]
    assert fit.num_prompt_tokens == true_length(fit, costs) == 20
    with pytest.raises(StageError) as info:
        context.fit(request("drop_oldest"), costs, 19)
    assert (info.value.code, info.value.field) == ("context_length", "messages")
    assert info.value.message.startswith(
        "the system prompt, documents and last message need 20 tokens"
    )


def test_budget_is_context_window_minus_max_tokens() -> None:
    assert context.budget_for(request("drop_oldest", max_tokens=192), 256) == 64
    with pytest.raises(
        StageError, match=r"max_tokens=256 leaves no room .* 256-token context window"
    ):
        context.budget_for(request("drop_oldest", max_tokens=256), 256)


def test_raw_prompt_fits_or_slides(costs: context.Costs) -> None:
    text = "one two three four five six seven"
    raw = Request(
        messages=[Message(role="user", content=text)], raw_prompt=True, truncation="sliding_window"
    )
    whole = context.fit_raw_prompt(raw, costs, 7)
    assert whole.messages == raw.messages and parts(whole) == [("user", 7, 0, 0)]
    assert not whole.truncated and whole.num_prompt_tokens == 7
    fit = context.fit_raw_prompt(raw, costs, 3)
    assert fit.messages[0].content == " five six seven" and parts(fit) == [("user", 3, 4, 0)]
    with pytest.raises(StageError, match="the prompt has 7 tokens but the context window leaves 3"):
        context.fit_raw_prompt(Request(messages=raw.messages, raw_prompt=True), costs, 3)


@pytest.mark.anyio
async def test_summarize_without_engine_falls_back_and_records_why(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No engine serves the nested run: it is cancelled after the timeout and drop_oldest applies."""
    monkeypatch.setenv(summarize.TIMEOUT_ENV, "0.5")
    monkeypatch.setenv(context.MAX_MODEL_LEN_ENV, "400")
    bus = await Bus.connect(bus_config)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: runtime.serve(
                context.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        await bus.publish(
            RequestAuthorized(
                request_id="s1", tenant="t", request=request("summarize", max_tokens=300)
            )
        )
        with anyio.fail_after(10):
            while not any(isinstance(e, ContextAssembled) for e in await bus.replay("s1")):
                await anyio.sleep(0.05)
        stop.set()
    (out,) = [e for e in await bus.replay("s1") if isinstance(e, ContextAssembled)]
    assert out.fallback == "no summary from run s1-sum within 0.5 s (BRIGADE_SUMMARY_TIMEOUT_S)"
    assert out.max_prompt_tokens == 100 and out.num_prompt_tokens == 94
    assert [p.name for p in out.parts] == ["system", "documents", "history", "user", "template"]
    nested = await bus.replay("s1-sum")
    # the nested run went through this same context stage; nothing serves `tokenized` here
    assert [type(e) for e in nested] == [RequestAuthorized, ContextAssembled, CancelRequested]
    asked = nested[0].request
    assert (nested[0].tenant, asked.sampling.temperature, asked.messages[0].content) == (
        "t",
        0.0,
        summarize.INSTRUCTION,
    )
    # the summary would have covered exactly the messages dropped to make room for it
    # room beside the fixed parts: 100 - 36 = 64; the summary may take half of 64 - 9 (its
    # header) - 2 = 26 tokens, so 64 - 37 = 27 are left for history: only message 9 (15) stays
    assert asked.sampling.max_tokens == 26
    assert asked.messages[1].content == summarize.transcript(HISTORY[:9])
    assert nested[2].reason == "timeout"
    await bus.close()
