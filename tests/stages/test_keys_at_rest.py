"""No API key rests in the clear: the whole pipeline (every stage, the edge, the archiver) on a
file-backed JetStream, a key sent through every door, then every file under the data dir
(JetStream's stores and KV, the Parquet archive, the ledger's DuckDB, the logs) is read for it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import anyio
import duckdb
import httpx
import msgspec
import pytest
import websockets

from schemas import settings, subjects
from schemas.events import Message, RequestAuthorized, RunBilled, Submit
from stages.edge.keys import KeyRing
from stages.runtime import deadletter, natsd
from stages.runtime.bus import Bus, BusConfig, publish_submit
from stages.tenancy import tenants
from tests.stages.pipeline_harness import MODEL, running_pipeline
from tools.busclient import EventTap
from tools.stage import serve_stage

pytestmark = pytest.mark.anyio
KEYS = {  # tenant -> its key; each goes through one door
    "http": "brg-rest-http-7f3a9c1e5b2d4a6f8e0c",
    "socket": "brg-rest-socket-2b8d4f6a0c1e3a5b7d9f",
    "header": "brg-rest-header-9e1c3a5b7d2f4a6c8e0b",
    "body": "brg-rest-oldbody-4d6f8a0c2e1b3a5c7e9d",
    "tap": "brg-rest-tap-6a8c0e2b4d1f3a5b7c9e",
}
UNKNOWN_KEY = "brg-rest-unknown-1a3c5e7b9d2f4a6c8e0d"  # no tenant: auth refuses it
CANARY_KEY = "brg-rest-canary-8b0d2f4a6c1e3a5b7d9c"  # the scanner's own check
# What the services log through (not the test's own HTTP and websocket clients, which log the
# Authorization header they send at DEBUG).
SERVICE_LOGGERS = ("brigade", "uvicorn", "nats")


def _all_keys() -> list[str]:
    return [*KEYS.values(), UNKNOWN_KEY]


def _text_of_parquet(path: Path) -> str:
    con = duckdb.connect()
    rows = con.execute(f"SELECT * FROM read_parquet('{path}')").fetchall()
    return json.dumps(rows, default=str)


def _text_of_duckdb(path: Path) -> str:
    con = duckdb.connect(str(path), read_only=True)
    try:
        out = []
        for (table,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'"
        ).fetchall():
            out.append(json.dumps(con.execute(f'SELECT * FROM "{table}"').fetchall(), default=str))
        return "\n".join(out)
    finally:
        con.close()


def readable(path: Path) -> bytes:
    """A file's bytes, and for compressed formats (Parquet pages, DuckDB's columns) their rows."""
    data = path.read_bytes()
    if path.suffix == ".parquet":
        data += _text_of_parquet(path).encode()
    elif path.suffix == ".duckdb":
        data += _text_of_duckdb(path).encode()
    return data


def scan(root: Path, needles: list[str]) -> dict[str, list[str]]:
    """needle -> the files (relative to root) that hold it."""
    found: dict[str, list[str]] = {n: [] for n in needles}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        data = readable(path)
        for needle in needles:
            if needle.encode() in data:
                found[needle].append(str(path.relative_to(root)))
    return found


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "tenants.toml"
    for tenant, key in KEYS.items():
        tenants.add_key(tenant, path=path, api_key=key)
    monkeypatch.setenv(settings.TENANTS.name, str(path))
    monkeypatch.setenv(settings.LEDGER_DB.name, str(tmp_path / "ledger.duckdb"))
    monkeypatch.setenv(settings.ARCHIVE_DIR.name, str(tmp_path / "archive"))
    handler = logging.FileHandler(tmp_path / "services.log")  # the services' logs, at DEBUG
    loggers = [logging.getLogger(name) for name in SERVICE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        yield tmp_path
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
        handler.close()


async def _through_every_door(edge, bus: Bus) -> list[str]:
    """One run per key and door; returns the request ids of the runs that should be billed."""
    auth = {"Authorization": f"Bearer {KEYS['http']}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=edge.url, headers=auth, timeout=60) as http:
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        http_id = reply.json()["id"].removeprefix("chatcmpl-")
        refused = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {UNKNOWN_KEY}"}
        )
        assert refused.status_code == 401
    socket_auth = {"Authorization": f"Bearer {KEYS['socket']}"}
    async with websockets.connect(edge.ws_url, additional_headers=socket_auth) as ws:
        await ws.send(json.dumps({"type": "response.create", "response": {
            "messages": body["messages"], "max_tokens": 3}}))  # fmt: skip
        created = json.loads(await ws.recv())
        assert created["type"] == "response.created", created
        while json.loads(await ws.recv())["type"] == "response.output_text.delta":
            pass
    prompt = [Message(role="user", content="Hi")]
    header = await bus.submit(
        Submit(request_id="rest-header", messages=prompt, max_tokens=3), api_key=KEYS["header"]
    )
    assert header.accepted, header
    # an older client: the key in the body (read by the gateway; the queue is in memory)
    old = msgspec.json.encode(
        {"request_id": "rest-body", "api_key": KEYS["body"], "prompt": "Hi", "max_tokens": 3}
    )
    await bus.js.publish(subjects.SUBMIT, old)
    tap = EventTap(bus.nc, subject="llm.ev.rest-tap.>")  # loadgen's and replay's client
    await tap.start()
    record = await tap.submit(
        bus.js, Submit(request_id="rest-tap", api_key=KEYS["tap"], prompt="Hi", max_tokens=3)
    )
    with anyio.fail_after(60):
        await record.done.wait()
    await tap.stop()
    await publish_submit(  # auth refuses an unknown key: the failure names no key either
        bus.js, Submit(request_id="rest-unknown", prompt="Hi", max_tokens=3), api_key=UNKNOWN_KEY
    )
    return [http_id, created["request_id"], "rest-header", "rest-body", "rest-tap"]


async def _billed(bus: Bus, request_ids: list[str]) -> dict[str, RequestAuthorized]:
    with anyio.fail_after(60):
        while True:
            runs = {rid: await bus.replay(rid) for rid in request_ids}
            if all(any(isinstance(e, RunBilled) for e in events) for events in runs.values()):
                break
            await anyio.sleep(0.2)
    return {
        rid: next(e for e in events if isinstance(e, RequestAuthorized))
        for rid, events in runs.items()
    }


async def test_no_key_rests_in_any_file_under_the_data_dir(data_dir: Path) -> None:
    keys = KeyRing(Path(os.environ[settings.TENANTS.name]), (MODEL,))
    async with running_pipeline(data_dir, keys) as (edge, config):
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()
            tg.start_soon(
                lambda: serve_stage(
                    "archiver", config=config, stop=stop, ready=ready, handle_signals=False
                )
            )
            with anyio.fail_after(30):
                await ready.wait()
            bus = await Bus.connect(config)
            try:
                request_ids = await _through_every_door(edge, bus)
                owners = await _billed(bus, request_ids)
                assert [owners[rid].tenant for rid in request_ids] == list(KEYS)
                # the scanner's own check: a key in a file-backed stream is found
                await bus.js.add_stream(name="CANARY", subjects=["canary.in"], storage="file")
                await bus.js.publish("canary.in", CANARY_KEY.encode())
            finally:
                await bus.close()
            stop.set()  # the archiver writes what it holds
    assert (data_dir / "nats" / "jetstream").is_dir()
    assert list((data_dir / "archive").rglob("*.parquet")), "the archiver wrote nothing"
    found = scan(data_dir, [*_all_keys(), CANARY_KEY, *request_ids])
    for rid in request_ids:  # the log, its archive and the ledger hold the runs themselves
        assert any(p.endswith(".parquet") for p in found[rid]), (rid, found[rid])
        assert any(p.endswith(".blk") for p in found[rid]), (rid, found[rid])
        assert "ledger.duckdb" in found[rid], (rid, found[rid])
    assert any("CANARY" in p for p in found[CANARY_KEY]), found[CANARY_KEY]
    assert {key: found[key] for key in _all_keys()} == {key: [] for key in _all_keys()}


async def test_a_submit_waiting_for_the_gateway_never_reaches_the_disk(tmp_path: Path) -> None:
    """Submits queued while no gateway runs (a backlog, a gateway down) wait in memory: the
    server's data dir holds none of their keys, while the same bytes in a file-backed stream are
    on disk (the scanner's check, and the old queue's leak)."""
    server = natsd.start(tmp_path / "nats")
    try:
        bus = await Bus.connect(BusConfig(servers=(server.url,)))
        try:
            await bus.ensure_streams()
            for i in range(50):
                submit = Submit(request_id=f"queued-{i}", prompt="Hi", api_key=KEYS["header"])
                await publish_submit(bus.js, submit)
            old = {"request_id": "queued-old", "api_key": KEYS["body"], "prompt": "Hi"}
            await bus.js.publish(subjects.SUBMIT, msgspec.json.encode(old))
            await bus.js.add_stream(name="CANARY", subjects=["canary.in"], storage="file")
            await bus.js.publish("canary.in", CANARY_KEY.encode())
            info = await bus.js.stream_info(subjects.SUBMIT_STREAM)
            assert (info.config.storage, info.state.messages) == ("memory", 51)
        finally:
            await bus.close()
    finally:
        natsd.stop(server)  # the server writes what it holds to disk as it stops
    found = scan(tmp_path, [KEYS["header"], KEYS["body"], CANARY_KEY])
    assert found[CANARY_KEY], "the scanner did not find the file-backed canary"
    assert (found[KEYS["header"]], found[KEYS["body"]]) == ([], [])


async def test_a_file_backed_submit_queue_is_recreated_in_memory(tmp_path: Path) -> None:
    """A data dir from before keeps llm.in's queue on disk: set-up recreates it in memory, and
    the keys its files held are gone with them."""
    server = natsd.start(tmp_path / "nats")
    try:
        bus = await Bus.connect(BusConfig(servers=(server.url,)))
        try:
            await bus.js.add_stream(
                name=subjects.SUBMIT_STREAM,
                subjects=[subjects.SUBMIT],
                retention="workqueue",
                storage="file",
            )
            old = {"request_id": "before", "api_key": KEYS["body"], "prompt": "Hi"}
            await bus.js.publish(subjects.SUBMIT, msgspec.json.encode(old))
            await bus.nc.flush()
            await anyio.sleep(0.2)
            assert scan(tmp_path, [KEYS["body"]])[KEYS["body"]], "the old queue held the key"
            await bus.ensure_streams()
            await bus.ensure_streams()  # idempotent once in memory
            info = await bus.js.stream_info(subjects.SUBMIT_STREAM)
            assert (info.config.storage, info.state.messages) == ("memory", 0)
        finally:
            await bus.close()
    finally:
        natsd.stop(server)
    assert scan(tmp_path, [KEYS["body"]]) == {KEYS["body"]: []}


async def test_a_dead_lettered_submit_keeps_no_key(tmp_path: Path) -> None:
    """A submit the gateway gives up on is recorded in the file-backed dead-letter stream with
    its body's first bytes: an older client's key in that body is blanked first."""
    server = natsd.start(tmp_path / "nats")
    try:
        bus = await Bus.connect(BusConfig(servers=(server.url,)))
        try:
            await bus.ensure_streams()
            old = {"api_key": KEYS["body"], "prompt": "Hi", "max_tokens": "not a number"}
            await bus.js.publish(subjects.SUBMIT, msgspec.json.encode(old))
            sub = await bus.js.pull_subscribe(subjects.SUBMIT, "keys-test", stream="BRIGADE_IN")
            (msg,) = await sub.fetch(1, timeout=5)
            letter = deadletter.letter_for("gateway", msg, "gave up")
            assert await deadletter.record(bus.js, letter)
            stored = await bus.js.get_last_msg(
                subjects.DEAD_STREAM, subjects.dead_letter("gateway")
            )
            assert b"[removed]" in stored.data and b'"prompt\\":\\"Hi\\"' in stored.data
            await msg.ack()
        finally:
            await bus.close()
    finally:
        natsd.stop(server)
    assert scan(tmp_path, [KEYS["body"]]) == {KEYS["body"]: []}
