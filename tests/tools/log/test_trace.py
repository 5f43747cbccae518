"""`brigade trace` on the synthetic log: every event with its offset, per-stage times, picture."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image

from stages.eventlog.parquet import ParquetLog
from tests.tools.log.synthlog import example_rows
from tools.cli import main
from tools.log.trace import draw_trace, format_trace
from tools.log.views import connect


def test_text_trace_lists_every_event_once_in_order():
    text = format_trace(connect(rows=example_rows()), "req-a")
    lines = text.splitlines()
    assert lines[0] == "request req-a  tenant acme  completed (stop)"
    assert lines[1].endswith("tokens in 5, out 3  TTFT 59.0 ms  TPOT 21.5 ms  E2E 102.0 ms")
    events = lines[4:18]
    assert [line.split()[:2] for line in events] == [
        ["1.00", "accepted"],
        ["3.00", "authorized"],
        ["6.00", "assembled"],
        ["8.00", "tokenized"],
        ["58.00", "tokens"],
        ["59.00", "text"],
        ["78.00", "tokens"],  # the redelivered duplicate of seq 1 appears once
        ["79.00", "text"],
        ["98.00", "tokens"],
        ["99.00", "text"],
        ["100.00", "finished"],
        ["101.00", "text"],
        ["102.00", "completed"],
        ["104.00", "billed"],
    ]
    assert events[4].split()[2:] == ["0", "40.000", "engine", "ids", "[101]"]
    assert events[5].endswith('detokenize "Hel"')
    stages = [line.split() for line in lines[20:]]
    assert stages == [
        ["gateway", "1", "0.500", "0.500"],
        ["auth", "1", "1.000", "1.000"],
        ["context", "1", "1.000", "2.000"],
        ["tokenize", "1", "1.000", "1.000"],
        ["engine", "1", "12.000", "80.000"],
        ["detokenize", "4", "3.100", "0.900"],
        ["ledger", "1", "1.000", "1.000"],
    ]


def test_failed_request_names_the_stage_and_reason():
    text = format_trace(connect(rows=example_rows()), "req-b")
    assert text.splitlines()[0] == "request req-b  tenant zeta  failed: unknown API key"
    assert "failed               0.400  auth       unauthorized at auth: unknown API key" in text


def test_unknown_request_is_none():
    assert format_trace(connect(rows=example_rows()), "req-zzz") is None


def test_picture_and_cli(tmp_path: Path, capsys):
    png = draw_trace(connect(rows=example_rows()), "req-a", tmp_path / "a.png")
    image = matplotlib.image.imread(png)  # [height, width, channels]
    assert image.shape[0] > 200 and image[..., :3].std() > 0.05
    archive = tmp_path / "archive"
    ParquetLog(archive).write(example_rows())
    base = ["--archive", str(archive), "--no-stream"]
    assert main(["trace", "req-b", *base]) == 0
    assert "unauthorized at auth" in capsys.readouterr().out
    assert main(["trace", "req-nope", *base]) == 1
    assert "no events of request req-nope" in capsys.readouterr().err
    assert main(["trace", "bad.id", *base]) == 2
