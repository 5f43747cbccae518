"""deploy/nats/brigade.conf on a real nats-server (random loopback ports): it parses, every stage
serves a chat as its own user, and a user is refused what its permissions leave out."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import nats
import nats.errors
import pytest
import yaml

from stages.edge.keys import KeyRing
from stages.runtime import natsd
from stages.runtime.bus import BusConfig
from stages.tenancy import tenants
from tests.stages.edge_harness import MODEL, running_edge
from tools import nats_auth, stage
from tools.stage import serve_stage
from tools.status import ready_here

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "nats" / "brigade.conf"
KEY = "brg-nats-auth-test-key-000000000000"
STAGES = ("gateway", "auth", "context", "tokenize", "engine", "detokenize", "ledger", "archiver")


def passwords() -> dict[str, str]:
    return {user.name: secrets.token_hex(16) for user in nats_auth.USERS}


def server_env(found: dict[str, str]) -> dict[str, str]:
    return {nats_auth.BY_NAME[name].password_variable: pw for name, pw in found.items()}


def test_the_committed_configuration_is_the_generated_one():
    assert CONF.read_text() == nats_auth.render(), "run: python -m tools.nats_auth > " + str(
        CONF.relative_to(ROOT)
    )


def test_the_configuration_parses_and_needs_every_password():
    binary = str(natsd.server_binary())
    ok = subprocess.run(
        [binary, "-t", "-c", str(CONF)], env=server_env(passwords()), capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = subprocess.run(
        [binary, "-t", "-c", str(CONF)], env={}, capture_output=True, text=True
    )
    assert missing.returncode != 0
    assert "NATS_PASSWORD_" in missing.stdout + missing.stderr


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """nats-server with the committed configuration: loopback, random ports, data in tmp_path."""
    found = passwords()
    ports = tmp_path / "ports"
    ports.mkdir()
    log = open(tmp_path / "nats.log", "wb")  # noqa: SIM115 - closed below
    conf = tmp_path / "brigade.conf"  # the committed file, its JetStream data under tmp_path
    conf.write_text(CONF.read_text().replace('store_dir: "/data"', f'store_dir: "{tmp_path}/js"'))
    args = ["-a", "127.0.0.1", "-p", "-1", "-m", "-1", "--ports_file_dir", str(ports)]
    proc = subprocess.Popen(
        [str(natsd.server_binary()), "-c", str(conf), *args],
        env=server_env(found),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        path = ports / f"nats-server_{proc.pid}.ports"
        for _ in range(500):
            if path.is_file() and path.read_text().strip():
                break
            assert proc.poll() is None, (tmp_path / "nats.log").read_text()
            time.sleep(0.01)
        yield json.loads(path.read_text())["nats"][0], found
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def as_user(url: str, found: dict[str, str], name: str) -> BusConfig:
    return BusConfig(servers=(url,), ack_wait_s=5.0, max_deliver=3, user=name, password=found[name])


async def connect(url: str, user: str, password: str, errors: list[str]):
    async def on_error(err: Exception) -> None:
        errors.append(str(err))

    return await nats.connect(
        url, user=user, password=password, error_cb=on_error, allow_reconnect=False
    )


@pytest.mark.anyio
async def test_every_stage_serves_a_chat_as_its_own_user(secured, tmp_path, monkeypatch):
    url, found = secured
    path = tmp_path / "tenants.toml"
    tenants.add_key("acme", path=path, api_key=KEY)
    monkeypatch.setenv("BRIGADE_TENANTS", str(path))
    monkeypatch.setenv("BRIGADE_LEDGER_DB", str(tmp_path / "ledger.duckdb"))
    monkeypatch.setenv("BRIGADE_ARCHIVE_DIR", str(tmp_path / "archive"))
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        for name in STAGES:
            ready = anyio.Event()
            tg.start_soon(
                lambda n=name, r=ready: serve_stage(
                    n, config=as_user(url, found, n), stop=stop, ready=r, handle_signals=False
                )
            )
            with anyio.fail_after(120):
                await ready.wait()
        for name in STAGES:  # compose's healthcheck: `brigade status --ready NAME` as NAME
            with anyio.fail_after(30):
                while not await ready_here(as_user(url, found, name), name):
                    await anyio.sleep(0.2)
        keys = KeyRing(path, (MODEL,))
        async with running_edge(as_user(url, found, "edge"), keys) as edge:
            auth = {"Authorization": f"Bearer {KEY}"}
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
            }
            async with httpx.AsyncClient(base_url=edge.url, headers=auth, timeout=60) as http:
                reply = await http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["usage"]["completion_tokens"] == 3
                rid = reply.json()["id"].removeprefix("chatcmpl-")
                with anyio.fail_after(30):
                    while (await http.get(f"/v1/runs/{rid}")).json()["state"] != "billed":
                        await anyio.sleep(0.1)
        stop.set()


@pytest.mark.anyio
async def test_a_user_is_refused_what_its_permissions_leave_out(secured):
    url, found = secured
    errors: list[str] = []
    admin = await connect(url, "admin", found["admin"], errors)
    js = admin.jetstream()
    await js.add_stream(name="BRIGADE_EVENTS", subjects=["llm.ev.>"])
    await admin.close()

    nc = await connect(url, "tokenize", found["tokenize"], errors)
    try:
        js = nc.jetstream()
        ack = await js.publish("llm.ev.r1.tokenized", b"{}", timeout=2)  # its own output
        assert ack.stream == "BRIGADE_EVENTS"
        for subject in ("llm.ev.r1.billed", "llm.in", "$JS.API.STREAM.DELETE.BRIGADE_EVENTS"):
            with pytest.raises(nats.errors.TimeoutError):  # the server drops it: no answer
                await nc.request(subject, b"{}", timeout=0.5)
        await nc.subscribe("llm.ev.r1.text")  # another stage's output: not its to read
        await nc.flush()
        await anyio.sleep(0.2)
    finally:
        await nc.close()
    text = "\n".join(errors).lower()
    for subject in ("llm.ev.r1.billed", "llm.in", "$js.api.stream.delete.brigade_events"):
        assert f'publish to "{subject}"' in text, errors
    assert 'subscription to "llm.ev.r1.text"' in text, errors
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # a wrong password
        await connect(url, "tokenize", "not-its-password", [])


def test_compose_runs_the_configuration_with_a_user_per_stage():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert compose["configs"]["nats-conf"]["file"] == "./" + str(CONF.relative_to(ROOT))
    users = {user.name: user for user in nats_auth.USERS}
    for node in ("nats", "nats-1", "nats-2", "nats-3"):
        env = compose["services"][node]["environment"]
        assert set(env) == {user.password_variable for user in nats_auth.USERS}
        for name, value in env.items():
            assert value.startswith("${" + name + ":?"), (node, name)  # unset: compose refuses
    for name in stage.available():
        env = compose["services"][name]["environment"]
        assert env["BRIGADE_NATS_USER"] == name, f"{name} connects as {env['BRIGADE_NATS_USER']}"
        assert env["BRIGADE_NATS_PASSWORD"].startswith("${" + users[name].password_variable + ":?")


def test_the_env_file_gives_every_user_a_fresh_password():
    first, second = nats_auth.env_file(), nats_auth.env_file()
    lines = dict(line.split("=", 1) for line in first.splitlines())
    assert set(lines) == {user.password_variable for user in nats_auth.USERS}
    assert all(len(pw) >= 32 for pw in lines.values()) and first != second
