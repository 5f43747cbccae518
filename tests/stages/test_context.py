"""The context stage on the bus: `summarize` without an engine falls back to dropping, and says why.
(The fitting itself: test_fit.py; a summary the engine writes: test_pipeline.py.)"""

from __future__ import annotations

import anyio
import pytest

from schemas import settings
from schemas.events import CancelRequested, ContextAssembled, RequestAuthorized
from stages import context, summarize
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from tests.stages.test_fit import HISTORY, request


@pytest.mark.anyio
async def test_summarize_without_engine_falls_back_and_records_why(
    bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No engine serves the nested run: it is cancelled after the timeout and drop_oldest applies."""
    monkeypatch.setenv(settings.SUMMARY_TIMEOUT_S.name, "0.5")
    monkeypatch.setenv(settings.MAX_MODEL_LEN.name, "400")
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
