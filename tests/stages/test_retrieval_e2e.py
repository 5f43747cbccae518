"""Retrieval end to end: the fixture corpus uploaded through the ingest service, a question asked
through the openai SDK with `retrieval`, and the run's assembled event holds the supporting chunk
(found, reranked by the served model through the engine, kept). Another tenant asking for the
same collection gets a 400 that reads as a missing collection."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import anyio
import openai
import pytest

from schemas import settings
from schemas.events import ContextAssembled
from stages.runtime.bus import Bus
from stages.tenancy import tenants
from tests.stages.edge_harness import ACME_KEY, GLOBEX_KEY, MODEL
from tests.stages.pipeline_harness import running_pipeline
from tools import docs
from tools.bench.rag import DATA, corpus_files
from tools.stage import serve_stage

pytestmark = [pytest.mark.anyio, pytest.mark.nats]
QUESTION = "On what date was Walter Elliot born?"
EVIDENCE = "born March 1, 1760"


def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


async def test_a_question_is_grounded_in_the_uploaded_corpus(tmp_path, monkeypatch) -> None:
    path = tmp_path / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=ACME_KEY)
    tenants.add_key("globex", path=path, api_key=GLOBEX_KEY)
    for setting, value in (
        (settings.TENANTS, path),
        (settings.LEDGER_DB, tmp_path / "ledger.duckdb"),
        (settings.RETRIEVAL_DB, tmp_path / "retrieval.duckdb"),
        (settings.RERANK_TIMEOUT_S, 300),  # six prefills on a loaded 2-core machine
    ):
        monkeypatch.setenv(setting.name, str(value))
    from stages.edge.keys import KeyRing

    async with running_pipeline(tmp_path, KeyRing(path, (MODEL,))) as (edge, config):
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()
            tg.start_soon(
                lambda: serve_stage("ingest", config=config, stop=stop, ready=ready, handle_signals=False)
            )  # fmt: skip
            with anyio.fail_after(120):
                await ready.wait()
            documents = docs.read_documents(corpus_files())
            args = SimpleNamespace(tenant="acme", collection="fixture", timeout=300.0)
            assert await docs.add(args, config, documents) == 0

            client = openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=ACME_KEY, max_retries=0)
            retrieval = {"collections": ["fixture"], "top_k": 3, "over_retrieve": 2}
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=8,
                temperature=0.0,
                extra_body={"retrieval": retrieval},
            )
            request_id = reply.id.removeprefix("chatcmpl-")
            bus = await Bus.connect(config)
            try:
                (assembled,) = [
                    e for e in await bus.replay(request_id) if isinstance(e, ContextAssembled)
                ]
            finally:
                await bus.close()
            trace = assembled.retrieval
            assert trace is not None and trace.rerank_fallback is None
            assert trace.num_candidates == 6 and trace.num_kept == 3
            assert all(c.rerank_score is not None for c in trace.chunks)
            system = norm(assembled.request.messages[0].content)
            assert norm(EVIDENCE) in system  # the supporting chunk is in the prompt
            kept = [c for c in trace.chunks if c.kept]
            assert any(c.source == "persuasion_ch1-8.md" for c in kept)
            assert assembled.num_prompt_tokens <= assembled.max_prompt_tokens

            other = openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=GLOBEX_KEY, max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                await other.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": QUESTION}],
                    max_tokens=4,
                    extra_body={"retrieval": retrieval},
                )
            assert "no collection named 'fixture'" in str(err.value)
            stop.set()
    assert DATA.is_dir() and os.environ[settings.RETRIEVAL_DB.name]
