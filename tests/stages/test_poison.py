"""Poison never loops and never kills: JSON nested 1,000 deep, truncated JSON, wrong types,
bytes that are not UTF-8 and multi-megabyte payloads on llm.in and on every event subject,
against every stage, the edge's run-state projector, the archiver and the sweeper on a real
nats-server. Each is settled once (a `failed` event for the request it names, else a dead
letter with the reason, subject and stream seq), none is redelivered, and afterwards a normal
request is served and billed."""

from __future__ import annotations

import anyio
import httpx
import pytest

from schemas import settings, subjects
from schemas.events import RequestFailed, decode_event
from stages.eventlog import archiver, sweeper
from stages.runtime import deadletter
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.tenancy import tenants
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests
from tests.stages.pipeline_harness import running_pipeline

pytestmark = pytest.mark.anyio
EVENTS = ("accepted", "authorized", "assembled", "tokenized", "started", "tokens", "finished",
          "text", "cancel", "completed", "cancelled", "failed", "billed")  # fmt: skip
DEEP = b"[" * 1000 + b"]" * 1000


def poisons(kind: str) -> dict[str, bytes]:
    """name -> payload; `named-*` payloads name a request id before their poison."""
    tag = kind.encode()
    return {
        "deep": b'{"type": "' + tag + b'", "x": ' + DEEP + b"}",
        "named-deep": b'{"request_id": "pz-deep-' + tag + b'", "type": "' + tag + b'", "x": '
        + DEEP + b"}",
        "truncated": b'{"type": "' + tag + b'", "seq": 1, "token_ids": [1, 2',
        "named-wrong-types": b'{"request_id": "pz-types-' + tag + b'", "type": "' + tag
        + b'", "seq": "one", "token_ids": "x", "tenant": 5, "usage": [], "prompt": 7}',
        "not-utf8": b"\xff\xfe\x00{",
        "not-json": b"hello",
    }  # fmt: skip


def huge(kind: str) -> bytes:
    return b'{"type": "' + kind.encode() + b'", "pad": "' + b"a" * (4 << 20) + b'"}'


async def _settled(bus: Bus, timeout_s: float) -> dict[str, object]:
    """Wait until every durable on the two streams has nothing pending or unacked."""
    with anyio.fail_after(timeout_s):
        while True:
            infos = [
                c
                for stream in (subjects.EVENTS_STREAM, subjects.SUBMIT_STREAM)
                for c in await bus.js.consumers_info(stream)
                if c.config.durable_name
            ]
            if all(c.num_pending == 0 and c.num_ack_pending == 0 for c in infos):
                return {c.name: c for c in infos}
            await anyio.sleep(0.2)


async def _dead_letters(bus: Bus) -> list[deadletter.DeadLetter]:
    info = await bus.js.stream_info(subjects.DEAD_STREAM)
    return [
        deadletter.decode((await bus.js.get_msg(subjects.DEAD_STREAM, seq)).data)
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
        if info.state.messages
    ]


async def test_poison_on_every_subject_is_settled_once_and_the_pipeline_still_serves(
    tmp_path, monkeypatch
):
    keys = keyring_for_tests(tmp_path)
    monkeypatch.setenv(settings.TENANTS.name, str(tmp_path / "tenants.toml"))
    monkeypatch.setenv(settings.LEDGER_DB.name, str(tmp_path / "ledger.duckdb"))
    assert tenants.read_file(tmp_path / "tenants.toml").tenants["acme"]
    async with running_pipeline(tmp_path, keys) as (edge, config):
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            for spec in (
                archiver.spec(archiver.ArchiverConfig(archive_dir=tmp_path / "archive")),
                sweeper.spec(sweeper.SweeperConfig(period_s=0.5)),
            ):
                ready = anyio.Event()
                tg.start_soon(
                    lambda s=spec, r=ready: runtime.serve(
                        s, config=config, stop=stop, ready=r, handle_signals=False
                    )
                )
                await ready.wait()
            await _poison_and_check(edge, config)
            stop.set()


async def _poison_and_check(edge, config: BusConfig) -> None:
    bus = await Bus.connect(config)
    sent: list[tuple[str, str, int]] = []  # (subject, poison name, stream seq)
    for kind in ("submit", *EVENTS):
        cases = poisons(kind) | ({"huge": huge(kind)} if kind in ("submit", "tokens") else {})
        for name, payload in cases.items():
            rid = f"pz-{name}-{kind}".replace("named-", "")
            # a routed event's poison goes where its consumer reads: the model's own subject
            route = subjects.model_token(MODEL) if kind in subjects.ROUTED_EVENTS else None
            subject = (
                subjects.SUBMIT if kind == "submit" else subjects.event_subject(rid, kind, route)
            )
            ack = await bus.js.publish(subject, payload)
            sent.append((subject, name, ack.seq))
    consumers = await _settled(bus, 120)
    for name, info in consumers.items():
        assert info.num_redelivered == 0, f"{name} had a poison redelivered"

    letters = await _dead_letters(bus)
    keys = [(d.consumer, d.stream, d.stream_seq) for d in letters]
    assert len(keys) == len(set(keys)), "a poison was recorded twice by one consumer"
    by_seq = {(d.stream, d.stream_seq): d for d in letters}
    for subject, name, seq in sent:
        if subject == subjects.SUBMIT or name.startswith("named-"):
            continue  # the gateway fails every bad submit; a named one fails its request
        if subject.split(".")[3] in ("tokens", "tokenized", "assembled", "authorized", "accepted"):
            letter = by_seq[(subjects.EVENTS_STREAM, seq)]  # some stage consumes it
            assert letter.subject == subject and letter.reason, letter
    deep = next(d for d in letters if d.subject == "llm.ev.pz-deep-tokens.tokens")
    assert "nested deeper than 64 levels" in deep.reason and deep.size > 2000

    for kind in ("tokens", "tokenized", "completed"):  # named: a `failed` event for the request
        events = await bus.replay(f"pz-types-{kind}")
        failed = [e for e in events if isinstance(e, RequestFailed)]
        assert failed and failed[0].code == "invalid_request", (kind, events)

    async with httpx.AsyncClient(base_url=edge.url, timeout=120) as http:
        r = await http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {ACME_KEY}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4, "temperature": 0},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        rid = r.headers["x-request-id"]
        with anyio.fail_after(30):
            while (await http.get(f"/v1/runs/{rid}", headers={
                    "Authorization": f"Bearer {ACME_KEY}"})).json()["state"] != "billed":  # fmt: skip
                await anyio.sleep(0.1)
    await _settled(bus, 60)  # the archiver too: it archived every poison and went on
    last = (await bus.js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
    archived = (await bus.js.consumer_info(subjects.EVENTS_STREAM, archiver.DURABLE)).ack_floor
    assert archived.stream_seq >= last - 20  # within the last file's age of the end
    for subject, _, seq in sent:
        if subject != subjects.SUBMIT:
            raw = await bus.js.get_msg(subjects.EVENTS_STREAM, seq)
            assert raw.data  # the log keeps every poison; nothing deleted it
    with pytest.raises(Exception):  # noqa: B017, PT011 - the deep one still does not decode
        decode_event(DEEP)
    await bus.close()
