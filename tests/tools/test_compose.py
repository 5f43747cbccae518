"""compose.yaml runs every stage exactly as the tests and `brigade up --procs` start it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

from stages.runtime.bus import BusConfig
from tests.stages import pipeline_harness, test_pipeline
from tools import stage

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def entrypoint() -> list[str]:
    line = next(
        line
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("ENTRYPOINT")
    )
    return yaml.safe_load(line.removeprefix("ENTRYPOINT"))


def test_every_stage_has_a_service_running_the_tests_command(compose):
    # The pipeline tests start these stages, as `python -m tools.cli stage NAME` processes.
    assert pipeline_harness.PIPELINE == test_pipeline.STAGES == stage.PIPELINE
    assert '"tools.cli", "stage", name]' in inspect.getsource(test_pipeline.Pipeline.start)
    services = compose["services"]
    for name in stage.available():
        assert name in services, f"compose.yaml has no service for stage {name!r}"
        assert entrypoint() + services[name]["command"] == stage.command(name)
        env = services[name]["environment"]
        assert env["NATS_URL"] == "${NATS_URL:-nats://nats:4222}"
        assert env["BRIGADE_STREAM_REPLICAS"] == "${BRIGADE_STREAM_REPLICAS:-1}"
        assert "brigade-data:/data" in services[name]["volumes"]


def test_stages_scale_and_only_the_edge_publishes_a_port(compose):
    for name, service in compose["services"].items():
        assert "container_name" not in service, f"{name} pins a container name: cannot --scale"
        if name != "edge":
            assert "ports" not in service, f"{name} publishes a port: cannot --scale"
    assert compose["services"]["edge"]["ports"] == ["8080:8080"]
    assert compose["services"]["edge"]["environment"]["BRIGADE_EDGE_HOST"] == "0.0.0.0"


def test_nats_has_jetstream_and_a_three_node_cluster_profile(compose):
    conf = (ROOT / compose["configs"]["nats-conf"]["file"]).read_text()
    assert re.search(r"jetstream\s*\{", conf) and "max_payload: 16MB" in conf
    services = compose["services"]
    assert "profiles" not in services["nats"]
    nodes = [f"nats-{i}" for i in (1, 2, 3)]
    routes = ",".join(f"nats://{n}:6222" for n in nodes)
    for node in nodes:
        args = services[node]["command"]
        assert services[node]["profiles"] == ["cluster"]
        assert args[args.index("-n") + 1] == node
        assert args[args.index("--routes") + 1] == routes
        assert args[args.index("--cluster_name") + 1] == "brigade"


def test_the_bus_reads_the_replicas_of_the_cluster_profile(monkeypatch):
    monkeypatch.setenv("BRIGADE_STREAM_REPLICAS", "3")
    urls = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
    config = BusConfig.from_env(urls)
    assert config.replicas == 3
    assert config.servers == tuple(urls.split(","))


def test_the_engine_and_background_stages_get_a_low_cpu_weight(compose):
    # Thread priorities stop at a container's cgroup: the weight ranks the containers.
    from tools.up import CHILD_STAGES

    services = compose["services"]
    for name in stage.available():
        shares = services[name].get("cpu_shares")
        if name in CHILD_STAGES:
            assert shares == 64, f"{name} runs at the default CPU weight"
        else:
            assert shares is None, f"{name} is on the request's path: default weight (1024)"


def test_every_service_has_a_healthcheck_and_waits_for_a_healthy_nats(compose):
    services = compose["services"]
    for node in ("nats", "nats-1", "nats-2", "nats-3"):
        assert "http://127.0.0.1:8222/healthz" in services[node]["healthcheck"]["test"]
    for name in stage.available():
        check = services[name]["healthcheck"]
        assert check["test"] == ["CMD", *entrypoint(), "status", "--ready", name]
        depends = services[name]["depends_on"]
        for node in ("nats", "nats-1", "nats-2", "nats-3"):  # the cluster profile's too
            assert depends[node] == {"condition": "service_healthy", "required": False}
    assert services["engine"]["healthcheck"]["start_period"] == "300s"  # loads the model
    assert services["edge"]["depends_on"]["gateway"] == {"condition": "service_healthy"}


def test_a_second_model_is_a_profile_with_an_engine_bound_to_it(compose):
    """Every stage reads the served models (the gateway refuses others, tokenize, context and
    detokenize use each one's tokenizer); `second-model` adds an engine bound to the second."""
    services = compose["services"]
    for name in stage.available():
        assert services[name]["environment"]["BRIGADE_MODEL"] == "${BRIGADE_MODEL:-smollm2-135m}"
    second, engine = services["engine-second"], services["engine"]
    assert second["profiles"] == ["second-model"] and "profiles" not in engine
    assert second["command"] == engine["command"] == ["stage", "engine"]
    assert second["environment"]["BRIGADE_ENGINE_MODEL"].startswith("${SECOND_MODEL:-")
    assert "BRIGADE_ENGINE_MODEL" not in engine["environment"]  # the first of BRIGADE_MODEL
    assert second["environment"]["BRIGADE_NATS_USER"] == "engine"
    assert "./models:/models:ro" in second["volumes"] and second["cpu_shares"] == 64


def test_the_engine_takes_the_coalescing_setting_from_the_host(compose):
    """`BRIGADE_STREAM_MAX_COALESCE=8 docker compose up --scale detokenize=2`: the engine reads
    it (docs/benchmarks.md, Serving under compose), the default stays one token an event."""
    env = compose["services"]["engine"]["environment"]
    assert env["BRIGADE_STREAM_MAX_COALESCE"] == "${BRIGADE_STREAM_MAX_COALESCE:-1}"
