"""`brigade replay`: the text re-streamed from the log is exactly what the client received live,
from the stream and from the Parquet archive alike."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from schemas import events as ev
from stages.eventlog.archiver import Archiver, ArchiverConfig
from stages.runtime.bus import Bus, BusConfig
from tools.busclient import EventTap
from tools.cli import main
from tools.log.replay import first_difference, submit_for
from tools.stage import serve_stage

TEXT = "Grüße 👋🏽 from 東京! Ünïcödé ✓"


async def stream_run(bus: Bus, rid: str, ids: list[int]) -> None:
    """Publish a run's engine output one token per step, as the engine stage does."""
    for seq, token in enumerate(ids):
        await bus.publish(
            ev.TokensGenerated(
                request_id=rid,
                tenant="dev",
                seq=seq,
                token_ids=[token],
                context_token_ids=ids[:seq],
            )
        )
    await bus.publish(
        ev.RunFinished(
            request_id=rid,
            tenant="dev",
            finish_reason="length",
            usage=ev.Usage(prompt_tokens=4, completion_tokens=len(ids)),
            last_seq=len(ids) - 1,
            context_token_ids=ids,
            seed=11,
        )
    )


@pytest.mark.anyio
async def test_replay_equals_what_the_client_received(
    bus_config: BusConfig, tmp_path: Path, monkeypatch, capsys
):
    from stages.tokenize import served_model, tokenizer_for

    ids = tokenizer_for(served_model()).encode(TEXT)  # the tokenizer detokenize itself uses
    assert len(ids) > 10
    bus = await Bus.connect(bus_config)
    await bus.ensure_streams()
    tap = EventTap(bus.nc)
    await tap.start()
    stop, ready = anyio.Event(), anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve_stage("detokenize", config=bus_config, stop=stop, ready=ready)
            )
            await ready.wait()
            record = tap.watch("rp-1")
            await stream_run(bus, "rp-1", ids)
            with anyio.fail_after(20):
                await record.done.wait()
            stop.set()
    finally:
        await tap.stop()
    received = record.text
    assert received == TEXT  # the real detokenizer, emoji and CJK split over tokens
    assert len(record.texts) == len(ids) + 1  # one delta per token event, plus the flush

    archive = tmp_path / "archive"
    monkeypatch.setenv("NATS_URL", bus_config.servers[0])
    await anyio.to_thread.run_sync(main, ["replay", "rp-1", "--archive", str(archive)])
    assert capsys.readouterr().out == received + "\n"  # from the stream (nothing archived yet)

    archiver = Archiver(bus, ArchiverConfig(archive_dir=archive, max_age_s=0.1, ack_wait_s=2))
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(archiver.run, stop)
        last = (await bus.js.stream_info("BRIGADE_EVENTS")).state.last_seq
        with anyio.fail_after(20):
            while archiver.stats.last_stream_seq < last:
                await anyio.sleep(0.05)
        stop.set()
    await bus.close()
    argv = ["replay", "rp-1", "--archive", str(archive), "--no-stream"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert capsys.readouterr().out == received + "\n"  # from the Parquet archive


def test_rerun_submit_asks_for_the_same_run():
    request = ev.Request(
        messages=[ev.Message(role="user", content="hi")],
        system="be brief",
        sampling=ev.Sampling(temperature=0.7, top_k=5, max_tokens=9, stop=["\n"]),
    )
    submit = submit_for(request, 1234, "x-rerun-1", "key")
    assert (submit.messages, submit.prompt, submit.system) == (request.messages, None, "be brief")
    assert (submit.temperature, submit.top_k, submit.max_tokens, submit.stop) == (0.7, 5, 9, ["\n"])
    assert (submit.seed, submit.request_id, submit.idempotency_key) == (1234, "x-rerun-1", None)
    raw = ev.Request(messages=[ev.Message(role="user", content="1 2 3")], raw_prompt=True)
    assert (submit_for(raw, None, "y", None).prompt, submit_for(raw, None, "y", None).messages) == (
        "1 2 3",
        None,
    )


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.anyio
async def test_real_run_replays_as_received_and_reruns_identically(brigade_up, monkeypatch, capsys):
    """Through every stage with the real model: replay gives the client's text; --rerun with
    the run's seed gives the same token ids (sampled at temperature 0.9, so the seed matters)."""
    from tools.log.source import connect

    brigade_up.env(monkeypatch)
    bus = await connect("test-replay")
    tap = EventTap(bus.nc)
    await tap.start()
    try:
        submit = ev.Submit(
            request_id="replay-real-1",
            api_key=brigade_up.api_key,
            messages=[ev.Message(role="user", content="Write one line about the sea.")],
            temperature=0.9,
            max_tokens=8,
            seed=20261129,
        )
        record = await tap.submit(bus.js, submit)
        with anyio.fail_after(120):
            await record.done.wait()
    finally:
        await tap.stop()
        await bus.close()
    assert record.ok and len(record.all_token_ids()) == 8
    assert await anyio.to_thread.run_sync(main, ["replay", "replay-real-1"]) == 0
    assert capsys.readouterr().out == record.text + "\n"
    assert await anyio.to_thread.run_sync(main, ["replay", "replay-real-1", "--rerun"]) == 0
    out = capsys.readouterr().out
    assert "8 token ids vs 8 originally" in out and "identical token ids" in out
