"""`brigade up` on an external NATS: "up" only once every stage beats ready; a SIGKILLed stage
process comes back (backoff, logged) and serves; Ctrl-C stops everything within the bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from schemas import subjects
from schemas.events import Submit
from stages.runtime import heartbeat
from stages.runtime.bus import Bus, BusConfig
from stages.runtime.natsd import NatsServer


def _start_up(tmp_path: Path, url: str, stages: str, *extra: str, **env_extra: str):
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "BRIGADE_ARCHIVE_DIR")}
    env.update(BRIGADE_DATA_DIR=str(tmp_path / "data"), **env_extra)
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "up", "--nats-url", url, "--stages", stages,
             "--log-level", "WARNING", *extra],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )  # fmt: skip
    return proc, log_path


def _wait_for(log_path: Path, proc: subprocess.Popen, text: bytes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in brigade up's log:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> float:
    """SIGINT (Ctrl-C); the seconds it took to exit."""
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("brigade up did not stop within 30 s")
    return time.monotonic() - started


def _status(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "status", "--nats-url", url, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def _ready_pid(config: BusConfig, stage: str, not_pid: int | None, timeout_s: float) -> int:
    """The pid of a worker of `stage` that beats ready (other than `not_pid`)."""
    bus = await Bus.connect(config)
    try:
        kv = await bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
        with anyio.fail_after(timeout_s):
            while True:
                pids = {b.pid for b in await heartbeat.beats(kv) if b.stage == stage and b.ready}
                pids.discard(not_pid)
                if pids:
                    return pids.pop()
                await anyio.sleep(0.2)
    finally:
        await bus.close()


async def _submit(config: BusConfig, request_id: str) -> bool:
    bus = await Bus.connect(config)
    try:
        reply = await bus.submit(Submit(request_id=request_id, prompt="Hi", api_key="k"))
        return reply.accepted
    finally:
        await bus.close()


def test_a_sigkilled_stage_process_comes_back_and_serves(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    config = BusConfig(servers=(nats_server.url,))
    proc, log_path = _start_up(tmp_path, nats_server.url, "gateway", "--procs")
    try:
        _wait_for(log_path, proc, b"Brigade is up", 120)
        first = anyio.run(_ready_pid, config, "gateway", None, 10.0)
        assert first != proc.pid  # --procs: the stage is a child
        assert anyio.run(_submit, config, "before-kill")
        status = _status(nats_server.url, "--json")
        assert status.returncode == 0, status.stderr
        stages = json.loads(status.stdout)["stages"]
        assert stages["gateway"]["ready"] == 1 and stages["gateway"]["pids"] == [first]
        assert _status(nats_server.url, "--ready", "gateway").returncode == 0
        assert _status(nats_server.url, "--ready", "engine").returncode == 1  # not started
        os.kill(first, signal.SIGKILL)
        second = anyio.run(_ready_pid, config, "gateway", first, 30.0)
        assert anyio.run(_submit, config, "after-kill")  # the restarted child serves
        log = log_path.read_text()
        assert f"stage gateway (pid {first}) exited with code -9; restarting in" in log
        assert f"stage gateway started again, pid {second}" in log
        assert proc.poll() is None  # `up` itself kept running
    finally:
        took = _stop(proc)
    assert proc.returncode == 0 and took < 10.0 + 2.0
    assert b"NATS stopped" not in log_path.read_bytes()  # an external NATS is not ours to stop


def _processes_with_env(needle: str) -> list[int]:
    """Pids of this user's processes whose environment holds `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours
                continue
    return found


def test_a_model_that_cannot_be_read_is_refused_before_anything_starts(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model" * 100)
    proc, log_path = _start_up(tmp_path, nats_server.url, "gateway,engine,detokenize",
                               "--model", f"bad={bad}")  # fmt: skip
    assert proc.wait(timeout=60) == 2
    log = log_path.read_text()
    assert log.startswith(f"brigade up: model bad: '{bad}' is not a GGUF file"), log
    assert "Traceback" not in log and "starting" not in log


def test_a_child_that_dies_while_the_others_start_stops_them_all(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Every stage starts at once: the engine child, whose model has a tokenizer but weights
    that are not safetensors, exits while gateway, auth and detokenize start in `up` itself.
    `up` names the stage, exits 1 and leaves no process behind."""
    from tests.engine.tiny_llama import write_tiny_llama_with_tokenizer

    tiny = write_tiny_llama_with_tokenizer(tmp_path / "tiny-llama", "smollm2-135m")
    for weights in tiny.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors" * 100)
    proc, log_path = _start_up(tmp_path, nats_server.url, "gateway,auth,engine,detokenize",
                               "--model", f"tiny={tiny}")  # fmt: skip
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = log_path.read_text()
    assert proc.returncode == 1, log[-3000:]
    assert "brigade up: stage engine exited with code 1" in log
    assert "Brigade is up" not in log
    deadline = time.monotonic() + 10.0  # the children die with `up` (PDEATHSIG)
    while (left := _processes_with_env(str(tmp_path / "data"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def test_a_stage_that_ignores_sigterm_is_killed_within_the_shutdown_bound(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    proc, log_path = _start_up(
        tmp_path, nats_server.url, "gateway,auth", "--procs", BRIGADE_SHUTDOWN_TIMEOUT_S="4"
    )
    config = BusConfig(servers=(nats_server.url,))
    try:
        _wait_for(log_path, proc, b"Brigade is up", 120)
        stuck = anyio.run(_ready_pid, config, "auth", None, 10.0)
        os.kill(stuck, signal.SIGSTOP)  # hung: neither drains nor answers SIGTERM
    finally:
        took = _stop(proc)
    assert took < 4.0 + 2.0, f"stopping took {took:.1f} s with a 4 s bound"
    with pytest.raises(ProcessLookupError):
        os.kill(stuck, 0)  # killed, not left behind


def _ask(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env.update(BRIGADE_DATA_DIR=str(tmp_path / "data"))  # the dev key `up` saved there
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "ask", "Hi", "--nats-url", url, "--max-tokens", "2",
         "--temperature", "0", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


async def _engine_beats(config: BusConfig, want: int, timeout_s: float) -> dict[str, int]:
    """{model: pid} of the ready engine workers, once `want` of them beat."""
    bus = await Bus.connect(config)
    try:
        kv = await bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
        with anyio.fail_after(timeout_s):
            while True:
                found = {
                    b.detail.get("model"): b.pid
                    for b in await heartbeat.beats(kv)
                    if b.stage == "engine" and b.ready
                }
                if len(found) >= want:
                    return found
                await anyio.sleep(0.2)
    finally:
        await bus.close()


async def _submit_for(config: BusConfig, model: str):
    bus = await Bus.connect(config)
    try:
        return await bus.submit(Submit(model=model, prompt="Hi", api_key="k"))
    finally:
        await bus.close()


def test_two_models_get_an_engine_worker_each_restarted_as_itself(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """`brigade up --model A --model B`: one engine child per model, each bound to its model
    (its announcement, its own durable on its model's subject); a killed one comes back bound
    to the same model; the gateway accepts both ids and refuses any other."""
    from tests.engine.tiny_llama import write_tiny_llama_with_tokenizer

    tiny = write_tiny_llama_with_tokenizer(tmp_path / "tiny-llama", "smollm2-135m")
    config = BusConfig(servers=(nats_server.url,))
    stages = "gateway,auth,context,tokenize,engine,detokenize"
    proc, log_path = _start_up(tmp_path, nats_server.url, stages,
                               "--model", "smollm2-135m", "--model", f"tiny={tiny}")  # fmt: skip
    try:
        _wait_for(log_path, proc, b"Brigade is up", 240)
        log = log_path.read_text()
        assert "models: smollm2-135m, tiny (default smollm2-135m)" in log
        assert "engine: loading smollm2-135m ... done" in log
        assert "engine: loading tiny ... done" in log
        workers = anyio.run(_engine_beats, config, 2, 10.0)
        assert set(workers) == {"smollm2-135m", "tiny"} and len(set(workers.values())) == 2
        status = json.loads(_status(nats_server.url, "--json").stdout)
        filters = {c["durable"]: c["filter"] for c in status["consumers"]}
        assert filters["brigade-engine-smollm2-135m"] == "llm.ev.*.tokenized.smollm2-135m"
        assert filters["brigade-engine-tiny"] == "llm.ev.*.tokenized.tiny"
        text = _status(nats_server.url).stdout  # each engine worker says which model it serves
        assert "model smollm2-135m loaded" in text and "model tiny loaded" in text
        tiny_ask = _ask(tmp_path, nats_server.url, "--model", "tiny")  # answered by tiny
        assert tiny_ask.returncode == 0 and "   model tiny" in tiny_ask.stderr, tiny_ask.stderr
        refused = _ask(tmp_path, nats_server.url, "--model", "gpt-4o")  # refused at once
        assert refused.returncode == 1
        assert "failed at gateway: model_not_found (field model)" in refused.stderr
        assert anyio.run(_submit_for, config, "tiny").accepted
        refused = anyio.run(_submit_for, config, "gpt-4o")
        assert (refused.accepted, refused.code) == (False, "model_not_found")

        os.kill(workers["tiny"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (again := anyio.run(_engine_beats, config, 2, 30.0))["tiny"] == workers["tiny"]:
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        assert again["smollm2-135m"] == workers["smollm2-135m"]  # the other one kept serving
        assert (
            f"stage engine@tiny (pid {workers['tiny']}) exited with code -9" in log_path.read_text()
        )
    finally:
        _stop(proc)
