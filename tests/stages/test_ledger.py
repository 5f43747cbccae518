"""Ledger: every terminal run billed exactly once in DuckDB, across redelivery and processes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import anyio
import duckdb
import pytest

from schemas import settings, subjects
from schemas.events import RequestFailed, RunBilled, RunCancelled, RunCompleted, Usage, encode
from stages import ledger
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig


def rows(path: Path) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(
            "SELECT billing_key, tenant, status, prompt_tokens, completion_tokens, detail "
            "FROM billing ORDER BY billing_key"
        ).fetchall()
    finally:
        con.close()


def completed(rid: str, tenant: str = "acme", n: int = 5) -> RunCompleted:
    return RunCompleted(
        request_id=rid,
        tenant=tenant,
        finish_reason="length",
        usage=Usage(prompt_tokens=12, completion_tokens=n),
    )


def test_first_bill_wins(tmp_path: Path) -> None:
    db = tmp_path / "ledger.duckdb"
    first = ledger.write_rows(db, [ledger.row_for(completed("r1"))])
    again = ledger.write_rows(
        db,
        [
            ledger.row_for(completed("r1", n=99)),
            ledger.row_for(
                RequestFailed(
                    request_id="r1", tenant="acme", stage="engine", code="internal", message="x"
                )
            ),
            ledger.row_for(
                RunCancelled(
                    request_id="r2",
                    tenant="acme",
                    reason="client",
                    usage=Usage(prompt_tokens=3, completion_tokens=1),
                )
            ),
        ],
    )
    assert (
        first["acme:r1:run"].usage.completion_tokens
        == again["acme:r1:run"].usage.completion_tokens
        == 5
    )
    assert rows(db) == [
        ("acme:r1:run", "acme", "completed", 12, 5, "length"),
        ("acme:r2:run", "acme", "cancelled", 3, 1, "client"),
    ]
    assert ledger.usage_by_tenant(db) == [
        ("acme", "cancelled", 1, 3, 1),
        ("acme", "completed", 1, 12, 5),
    ]


def _bill_many(db: str, start: int) -> None:
    ledger.write_rows(
        Path(db), [ledger.row_for(completed(f"p{i}")) for i in range(start, start + 30)]
    )


def test_two_processes_share_the_file(tmp_path: Path) -> None:
    db = tmp_path / "ledger.duckdb"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_bill_many, args=(str(db), s)) for s in (0, 15, 0, 15)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert [r[0] for r in rows(db)] == sorted(f"acme:p{i}:run" for i in range(45))


@pytest.mark.anyio
async def test_redelivered_terminal_events_bill_once(
    bus_config: BusConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "ledger.duckdb"
    monkeypatch.setenv(settings.LEDGER_DB.name, str(db))
    bus = await Bus.connect(bus_config)
    stop, ready = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: runtime.serve(
                ledger.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        # the same event three times without dedupe: what a redelivery looks like to the stage
        for _ in range(3):
            await bus.js.publish(subjects.event_subject("c1", "completed"), encode(completed("c1")))
        await bus.publish(
            RequestFailed(request_id="f1", stage="auth", code="unauthorized", message="no key")
        )
        await bus.publish(
            RunCancelled(
                request_id="x1", tenant="acme", usage=Usage(prompt_tokens=4, completion_tokens=2)
            )
        )
        with anyio.fail_after(10):
            while True:
                info = await bus.js.consumer_info(subjects.EVENTS_STREAM, "brigade-ledger")
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                await anyio.sleep(0.05)
        stop.set()
    assert rows(db) == [
        ("-:f1:run", None, "failed", 0, 0, "auth:unauthorized"),
        ("acme:c1:run", "acme", "completed", 12, 5, "length"),
        ("acme:x1:run", "acme", "cancelled", 4, 2, "client"),
    ]
    billed = [e for e in await bus.replay("c1") if isinstance(e, RunBilled)]
    assert [(b.status, b.billing_key, b.usage.completion_tokens) for b in billed] == [
        ("completed", "acme:c1:run", 5)
    ]
    await bus.close()


def test_inside_one_batch_the_first_row_of_a_key_wins(tmp_path: Path) -> None:
    """A batch is one INSERT: a run's `failed` and then its `completed` in the same batch bill
    the `failed`, as two batches would, and the batch's other rows go in beside them."""
    db = tmp_path / "ledger.duckdb"
    failed = RequestFailed(request_id="r1", tenant="acme", stage="engine", code="internal",
                           message="x")  # fmt: skip
    stored = ledger.write_rows(
        db,
        [ledger.row_for(e) for e in (failed, completed("r1", n=7), completed("r2"), failed)],
    )
    assert stored["acme:r1:run"].status == "failed" and stored["acme:r2:run"].usage == Usage(
        prompt_tokens=12, completion_tokens=5
    )
    assert rows(db) == [
        ("acme:r1:run", "acme", "failed", 0, 0, "engine:internal"),
        ("acme:r2:run", "acme", "completed", 12, 5, "length"),
    ]
