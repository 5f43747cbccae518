"""`brigade bench load`: a seeded workload, and on the real pipeline (every stage, the real
model, a real nats-server) client-side figures that agree with the event log's within a few ms."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest

from stages import tenants
from tools.cli import main
from tools.workload import Workload, parse_lengths, poisson_arrivals

KEY = "brg-bench-load-key-000000000000000"
AGREE_MS = 5.0  # client vs log, per request: "within a few milliseconds"


def test_workload_is_seeded_and_mixed():
    a = Workload(seed=3, prompt_words=(4, 32), output_tokens=(2, 8)).items(40)
    b = Workload(seed=3, prompt_words=(4, 32), output_tokens=(2, 8)).items(40)
    c = Workload(seed=4, prompt_words=(4, 32), output_tokens=(2, 8)).items(40)
    assert a == b and a != c
    assert {i.num_prompt_words for i in a} == {4, 32} and {i.max_tokens for i in a} == {2, 8}
    assert all(len(i.prompt.split()) == i.num_prompt_words + 3 for i in a)  # "Continue this text:"
    with pytest.raises(ValueError, match="1..8192"):
        Workload(output_tokens=(0,))
    with pytest.raises(ValueError, match="comma-separated"):
        parse_lengths("16,x", "--prompt-words")


def test_poisson_arrivals_have_the_asked_rate():
    offsets = poisson_arrivals(4.0, 4001, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == poisson_arrivals(4.0, 4001, seed=1)
    assert 4000 / offsets[-1] == pytest.approx(4.0, rel=0.05)
    with pytest.raises(ValueError, match="> 0"):
        poisson_arrivals(0.0, 3, seed=1)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(scope="module")
async def pipeline(tmp_path_factory):
    from stages.edge_keys import KeyRing
    from tests.stages.edge_harness import MODEL
    from tests.stages.pipeline_harness import running_pipeline

    data = tmp_path_factory.mktemp("bench-load")
    path = data / "tenants.toml"
    tenants.add_key("bench", path=path, api_key=KEY)
    before = {k: os.environ.get(k) for k in (tenants.TENANTS_ENV, "NATS_URL")}
    os.environ[tenants.TENANTS_ENV] = str(path)
    try:
        async with running_pipeline(data, KeyRing(path, (MODEL,))) as (edge, config):
            os.environ["NATS_URL"] = config.servers[0]
            yield edge, data
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_bench(out: Path, *extra: str) -> dict:
    argv = ["bench", "load", "--requests", "4", "--concurrency", "2", "--prompt-words", "8,24",
            "--output-tokens", "6,10", "--api-key", KEY, "--quiet", "--out", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    [doc] = [json.loads(p.read_text()) for p in out.glob("load-*.json")]
    return doc


def assert_agree(doc: dict) -> None:
    client, check = doc["client"], doc["cross_check"]
    assert (client["completed"], client["failed"], check["missing_in_log"]) == (4, 0, 0)
    for figure in ("ttft_ms", "e2e_ms"):
        diff = check["diff_ms"][figure]
        assert diff["n"] == 4
        # the client measures from its send to its receipt, the log from the gateway's receipt
        # to the publish: the difference is two bus hops, never negative by more than jitter
        assert diff["max_abs"] < AGREE_MS, (figure, diff)
    log = check["log"]
    assert (log["completed"], log["tokens_out"]) == (4, client["tokens_out"])
    for q in ("p50", "p95"):
        assert abs(client["itl_ms"][q] - log["itl_ms"][q]) < AGREE_MS


@pytest.mark.anyio
async def test_bus_client_figures_agree_with_the_log(pipeline, tmp_path: Path):
    doc = await anyio.to_thread.run_sync(run_bench, tmp_path / "bus")
    assert_agree(doc)


@pytest.mark.anyio
async def test_sse_client_figures_agree_with_the_log(pipeline, tmp_path: Path):
    edge, _ = pipeline
    doc = await anyio.to_thread.run_sync(
        lambda: run_bench(tmp_path / "sse", "--target", "sse", "--edge-url", edge.url)
    )
    assert_agree(doc)
    assert doc["client"]["errors"] == []
