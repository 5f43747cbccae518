"""The pipeline on a local three-node JetStream cluster with R3 streams: the node that leads the
event log is SIGKILLed mid-decode and started again. Every stage, the edge and the archiver
ride out the election (no crash); every streamed request completes once, with the text of the
same prompts run before the fault, its tokens stored once each, and it is billed once."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import pytest

from schemas import settings, subjects
from schemas.events import RunBilled, TokensGenerated
from stages.edge.admission import AdmissionConfig
from stages.eventlog import archiver
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.natscluster import NatsCluster
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests, running_edge
from tests.stages.pipeline_harness import start_stages
from tools.stage import PIPELINE

pytestmark = [pytest.mark.anyio, pytest.mark.nats]
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}
PROMPTS = ("Count to five.", "Name three colors.", "List four fruits.")


async def _stream(http: httpx.AsyncClient, prompt: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, "stream": True}  # fmt: skip
    text, error, done = [], None, False
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        rid = r.headers.get("x-request-id")
        if r.status_code != 200:
            return {"rid": rid, "status": r.status_code, "body": (await r.aread()).decode()}
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                error = chunk.get("error", error)
                text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    return {"rid": rid, "status": 200, "text": "".join(text), "error": error, "done": done}


async def _all(http: httpx.AsyncClient, out: dict[str, dict]) -> None:
    async def one(prompt: str) -> None:
        out[prompt] = await _stream(http, prompt)

    async with anyio.create_task_group() as tg:
        for prompt in PROMPTS:
            tg.start_soon(one, prompt)


async def _decoding(bus: Bus, rids_before: int) -> None:
    """Until runs of the second round have stored tokens (its first pieces are flowing)."""
    with anyio.fail_after(60):
        while True:
            info = await bus.js.stream_info(
                subjects.EVENTS_STREAM, subjects_filter=subjects.all_events("tokens")
            )
            if len(info.state.subjects or {}) > rids_before:
                return
            await anyio.sleep(0.02)


async def _settled(bus: Bus, rid: str) -> list:
    """The run's stored events once it is billed (the ledger runs after the client's end)."""
    with anyio.fail_after(60):
        while True:
            events = await bus.replay(rid)
            if any(isinstance(e, RunBilled) for e in events):
                return events
            await anyio.sleep(0.2)


async def test_the_event_log_leader_killed_mid_decode_loses_and_repeats_nothing(
    tmp_path, monkeypatch
):
    keys = keyring_for_tests(tmp_path)
    monkeypatch.setenv(settings.TENANTS.name, str(tmp_path / "tenants.toml"))
    monkeypatch.setenv(settings.LEDGER_DB.name, str(tmp_path / "ledger.duckdb"))
    cluster = NatsCluster(tmp_path / "nats").start()
    config = BusConfig(servers=cluster.urls, replicas=3, ack_wait_s=5.0, max_deliver=5)
    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await start_stages(tg, PIPELINE, config, stop, timeout_s=120)
            ready = anyio.Event()
            spec = archiver.spec(archiver.ArchiverConfig(archive_dir=tmp_path / "archive"))
            tg.start_soon(lambda: runtime.serve(spec, config=config, stop=stop, ready=ready,
                                                handle_signals=False))  # fmt: skip
            await ready.wait()
            bus = await Bus.connect(config)
            async with (
                # the fault is measured, not overload: requests may wait out the election
                running_edge(config, keys, admission=AdmissionConfig(max_wait_s=60.0)) as edge,
                httpx.AsyncClient(base_url=edge.url, timeout=120) as http,
            ):
                baseline: dict[str, dict] = {}
                await _all(http, baseline)
                assert all(b["status"] == 200 and b["done"] for b in baseline.values()), baseline
                info = await bus.js.stream_info(subjects.EVENTS_STREAM)
                assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
                leader = cluster.stream_leader(subjects.EVENTS_STREAM)
                assert leader == info.cluster.leader

                out: dict[str, dict] = {}
                async with anyio.create_task_group() as load:
                    load.start_soon(_all, http, out)
                    await _decoding(bus, len(PROMPTS))
                    assert len(out) < len(PROMPTS)  # the runs are mid-decode when it dies
                    cluster.kill(leader)
                    killed_at = time.monotonic()
                    await anyio.sleep(1.0)
                    cluster.launch(leader)
                # an election (4-9 s), and what it lost published again by the bus within a
                # few seconds, all at once: not 5 s per lost token as each run reaches its end
                # (the code before took 115 s; 15-44 s here, 60 keeps room for a loaded CI)
                assert time.monotonic() - killed_at < 60.0
                for prompt in PROMPTS:
                    got = out[prompt]
                    assert got["status"] == 200 and got["error"] is None and got["done"], got
                    assert got["text"] == baseline[prompt]["text"], (prompt, got)
                with anyio.fail_after(30):
                    while not cluster.healthy():
                        await anyio.sleep(0.2)
                # the stream has a leader again (the killed node, back within a second, may win
                # the election it missed)
                assert (await bus.js.stream_info(subjects.EVENTS_STREAM)).cluster.leader
                for prompt in PROMPTS:
                    events = await _settled(bus, out[prompt]["rid"])
                    billed = [e for e in events if isinstance(e, RunBilled)]
                    assert [b.status for b in billed] == ["completed"], billed
                    seqs = sorted(e.seq for e in events if isinstance(e, TokensGenerated))
                    assert seqs == list(range(len(seqs))), seqs  # each step stored once
            await bus.close()
            stop.set()
    finally:
        cluster.stop()
