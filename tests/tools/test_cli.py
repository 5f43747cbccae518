"""The `brigade` command: every listed module registers, --help stays light, and `up` + `ask`
from a second process serve a real request end to end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import cli

ROOT = Path(__file__).resolve().parents[2]


def brigade(
    *argv: str, env: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_listed_module_registers_a_command():
    import importlib

    for name in cli.COMMANDS + cli.BENCH:
        module = importlib.import_module(name)
        assert callable(module.register) and callable(module.run), name
    parser = cli.build_parser()
    for command in ("up", "stage", "ask", "status", "schema"):
        args = parser.parse_args([command, "x"] if command in ("stage", "ask") else [command])
        assert args.func.__module__ == f"tools.{command}"
    assert parser.parse_args(["bench", "pipeline"]).func.__module__ == "tools.bench.pipeline"


def test_help_imports_no_heavy_library():
    code = (
        "import sys; from tools.cli import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in ('torch', 'duckdb', 'matplotlib', 'engine.engine') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_schema_prints_the_submit_and_every_event(capsys):
    assert cli.main(["schema", "--indent", "0"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert list(table)[:2] == ["submit", "accepted"]
    assert {"tokens", "text", "finished", "completed", "cancel", "failed"} <= set(table)
    submit = table["submit"]["$defs"]["Submit"]["properties"]
    assert submit["top_p"] == {
        "type": "number",
        "exclusiveMinimum": 0.0,
        "maximum": 1.0,
        "default": 1.0,
    }
    assert cli.main(["schema", "nope"]) == 2
    assert "unknown name 'nope'" in capsys.readouterr().err


def test_commands_without_nats_say_how_to_get_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env["BRIGADE_DATA_DIR"] = str(tmp_path)
    for argv in (["ask", "hi"], ["status"], ["stage", "tokenize"]):
        out = brigade(*argv, env=env)
        assert out.returncode == 2, (argv, out.stderr)
        assert "no NATS server: set NATS_URL" in out.stderr and "brigade up" in out.stderr
    out = brigade("stage", "nonesuch", env=env)
    assert out.returncode == 2 and "unknown stage 'nonesuch'" in out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.nats
def test_up_then_ask_and_status_from_another_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "BRIGADE_API_KEY")}
    env |= {"BRIGADE_DATA_DIR": str(tmp_path), "BRIGADE_EDGE_PORT": str(free_port())}
    up = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "up"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("Brigade is up") for line in lines):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            lines.append(up.stderr.readline())
        key_line = next(line for line in lines if "dev tenant API key" in line)
        assert key_line.split(": ")[-1].strip() == (tmp_path / "dev.key").read_text().strip()
        assert any("engine: loading smollm2-135m ... done" in line for line in lines)

        ask = brigade("ask", "Say yes.", "--max-tokens", "3", "--seed", "5", env=env, timeout=240)
        assert ask.returncode == 0, ask.stderr
        assert ask.stdout.strip()
        assert "length, " in ask.stderr and "+ 3 output tokens, seed 5" in ask.stderr
        assert "TTFT" in ask.stderr and "per stage (ms): gateway" in ask.stderr

        status = brigade("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        durables = {c["durable"]: c for c in info["consumers"]}
        assert durables["brigade-engine-smollm2-135m"]["pending"] == 0
        assert durables["brigade-detokenize"]["ack_pending"] == 0
        assert info["workers"]["brigade-engine"] == 1  # its connection
    finally:
        up.send_signal(signal.SIGINT)
        rc = up.wait(timeout=60)
    assert rc == 0
    assert not (tmp_path / "nats.json").exists()  # NATS was stopped by its pid
