"""The report: its figures on the synthetic log, the SLA pass/fail logic, and every plot."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from stages.eventlog.parquet import ParquetLog
from tests.tools.log.synthlog import example_rows, generated_rows
from tools.cli import main
from tools.log.report import format_report, sla_lines, summarize, write_plots
from tools.log.sla import Sla, check, holds
from tools.log.views import connect


def verdicts(**figures) -> list[str]:
    return [line.verdict for line in check(Sla(), **figures)]


def test_sla_lines_pass_fail_and_no_data():
    good = dict(
        ttft_p95_ms=299.9, tps_p50=40.1, error_rate=0.00099, kv_usage_max=0.899, queue_depth_max=24
    )
    assert verdicts(**good) == ["PASS"] * 5
    assert holds(check(Sla(), **good))
    at_limits = dict(
        ttft_p95_ms=300.0, tps_p50=40.0, error_rate=0.001, kv_usage_max=0.9, queue_depth_max=25
    )
    assert verdicts(**at_limits) == ["FAIL"] * 5  # every target is strict
    missing = dict(good, kv_usage_max=None)
    assert verdicts(**missing) == ["PASS", "PASS", "PASS", "no data", "PASS"]
    assert not holds(check(Sla(), **missing))
    assert holds(check(Sla(), **missing), allow_missing=True)


def test_request_meets_sla():
    sla = Sla()
    assert sla.request_meets(ok=True, ttft_ms=120.0, tps=55.0)
    assert not sla.request_meets(ok=True, ttft_ms=300.0, tps=55.0)
    assert not sla.request_meets(ok=True, ttft_ms=120.0, tps=40.0)
    assert not sla.request_meets(ok=False, ttft_ms=120.0, tps=55.0)
    assert sla.request_meets(ok=True, ttft_ms=120.0, tps=None)  # a one-token answer
    with pytest.raises(ValueError, match="fractions"):
        Sla(error_rate=5.0)


def test_summary_of_the_synthetic_log():
    s = summarize(connect(rows=example_rows()))
    assert (s["requests"], s["completed"], s["failed"], s["in_flight"]) == (2, 1, 1, 0)
    assert (s["tokens_in"], s["tokens_out"]) == (5, 3)
    assert s["error_rate"] == 0.5
    assert s["errors"] == [{"code": "unauthorized", "stage": "auth", "n": 1}]
    assert s["ttft_ms"]["n"] == 1 and s["ttft_ms"]["p95"] == pytest.approx(59.0)
    assert s["itl_ms"]["n"] == 2 and s["itl_ms"]["p50"] == pytest.approx(21.0)
    assert s["span_s"] == pytest.approx(0.102)  # arrival at 0, req-a `completed` at 102 ms
    assert (s["queue_depth_max"], s["engine_waiting_max"], s["kv_usage_max"]) == (2, 1, 0.3125)
    lines = sla_lines(s, Sla())
    assert [(line.name, line.verdict) for line in lines] == [
        ("TTFT P95", "PASS"),
        ("TPS P50", "PASS"),  # 46.5 tok/s
        ("Error rate", "FAIL"),  # 1 of 2 failed
        ("KV memory", "PASS"),
        ("Queue depth", "PASS"),
    ]
    text = format_report(s, lines)
    assert "| Error rate | < 0.1 % | 50 % | FAIL |" in text
    assert "| engine | 1 |" in text and "SLA does not hold." in text


def assert_real_png(path: Path) -> None:
    image = matplotlib.image.imread(path)  # [height, width, channels]
    assert image.shape[0] > 200 and image.shape[1] > 400, image.shape
    assert image[..., :3].std() > 0.05, f"{path.name} is blank"


def test_every_plot_is_written_and_not_blank(tmp_path: Path):
    con = connect(rows=generated_rows(30))
    paths = write_plots(con, summarize(con), Sla(), tmp_path / "png", slowest=5)
    assert [p.name for p in paths] == [
        "stage_latency.png",
        "ttft_histogram.png",
        "waterfall_slowest.png",
    ]
    for path in paths:
        assert_real_png(path)


def test_plots_of_an_empty_log_still_exist(tmp_path: Path):
    con = connect(tmp_path / "no-archive")
    for path in write_plots(con, summarize(con), Sla(), tmp_path / "png"):
        assert path.stat().st_size > 5000


def test_cli_report_from_an_archive(tmp_path: Path, capsys):
    archive = tmp_path / "archive"
    log = ParquetLog(archive)
    log.write(example_rows())
    log.commit(17)
    argv = ["report", "--archive", str(archive), "--no-stream", "--png", str(tmp_path / "png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "2 requests (1 completed, 1 failed" in out
        and "| TTFT P95 | < 300 ms | 59.0 ms | PASS |" in out
    )
    assert len(list((tmp_path / "png").glob("*.png"))) == 3
    assert main(["report", "--archive", str(archive), "--no-stream", "--check"]) == 1
    assert (
        main(["report", "--archive", str(archive), "--no-stream", "--tenant", "acme", "--check"])
        == 0
    )
