import re
from pathlib import Path

import pytest

from schemas import settings, subjects
from tools import config

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bBRIGADE_[A-Z0-9_]+")
NOT_VARIABLES = {subjects.EVENTS_STREAM, subjects.SUBMIT_STREAM, subjects.DEAD_STREAM}  # streams


def test_the_readme_table_is_the_generated_one():
    block = config.readme_table((ROOT / "README.md").read_text())
    assert block == settings.markdown_table(), (
        "README.md's settings table is out of date: run `brigade config --readme README.md`"
    )


def _used_names() -> dict[str, str]:
    files = [ROOT / "compose.yaml", ROOT / "Dockerfile", ROOT / "README.md"]
    for package in ("stages", "tools", "engine", "kernels", "schemas"):
        files += sorted((ROOT / package).rglob("*.py"))
    found: dict[str, str] = {}
    for path in files:
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_code_names_is_declared():
    used = _used_names()
    assert "BRIGADE_DATA_DIR" in used  # the scan sees the code
    missing = {n: where for n, where in used.items() if n not in settings.BY_NAME}
    assert not missing.keys() - NOT_VARIABLES, f"declare these in schemas/settings.py: {missing}"


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("BRIGADE_ACK_WAIT_S", "abc", "BRIGADE_ACK_WAIT_S='abc': not a number (seconds before"),
        ("BRIGADE_ACK_WAIT_S", "0", "BRIGADE_ACK_WAIT_S='0': allowed: > 0"),
        ("BRIGADE_MAX_NUM_SEQS", "four", "BRIGADE_MAX_NUM_SEQS='four': not an integer"),
        ("BRIGADE_MAX_NUM_SEQS", "0", "allowed: >= 1 (sequences the engine runs"),
        ("BRIGADE_STREAM_REPLICAS", "2", "BRIGADE_STREAM_REPLICAS='2': allowed: 1, 3 or 5"),
        ("BRIGADE_BATCH_INVARIANT", "maybe", "'maybe' is not a flag; allowed: 1/0"),
        ("BRIGADE_DTYPE", "fp8", "allowed: float32, bfloat16 or float16"),
        ("BRIGADE_EDGE_PORT", "70000", "allowed: >= 1 and <= 65535 (port the edge listens on"),
        ("BRIGADE_EDGE_KV_WATERMARK", "1.5", "allowed: > 0 and <= 1"),
        ("BRIGADE_EDGE_KV_WATERMARK", "nan", "allowed: > 0 and <= 1"),
        ("BRIGADE_ENGINE_CPU_PRIORITY", "batch:20", "allowed: idle, batch, batch:N, nice:N"),
        ("BRIGADE_BACKGROUND_CPU_PRIORITY", "fast", "; default batch:19)"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name, text, says):
    found = settings.load({name: text})
    with pytest.raises(settings.InvalidSettings) as info:
        found.check()
    assert says in str(info.value)
    (error,) = info.value.errors
    assert (error.name, error.value) == (name, text)
    with pytest.raises(settings.InvalidSetting, match=re.escape(says)):
        settings.BY_NAME[name].get({name: text})
    assert settings.MODEL.get({name: text}) == "smollm2-135m"  # the others still read


def test_values_parse_to_their_types():
    env = {
        "NATS_URL": " nats://a:4222, nats://b:4222,,",
        "BRIGADE_DATA_DIR": "/srv/brigade",
        "BRIGADE_ACK_WAIT_S": "2.5",
        "BRIGADE_STREAM_REPLICAS": "3",
        "BRIGADE_PREFIX_CACHING": "Yes",
        "BRIGADE_CPU_KERNEL": "0",
        "BRIGADE_ENGINE_CPU_PRIORITY": " Nice:7 ",
        "BRIGADE_EDGE_PORT": "",  # empty counts as unset
    }
    found = settings.load(env).check()
    assert found[settings.NATS_URL] == ("nats://a:4222", "nats://b:4222")
    assert found[settings.DATA_DIR] == Path("/srv/brigade")
    assert found[settings.ACK_WAIT_S] == 2.5
    assert found[settings.STREAM_REPLICAS] == 3
    assert (found[settings.PREFIX_CACHING], found[settings.CPU_KERNEL]) == (True, False)
    assert found[settings.ENGINE_CPU_PRIORITY] == " Nice:7 "
    assert (found[settings.EDGE_PORT], found.source(settings.EDGE_PORT)) == (8080, "default")
    assert found.source(settings.ACK_WAIT_S) == "env"
    assert found[settings.MAX_DELIVER] is None


def test_the_defaults_are_what_the_readers_used_before():
    before = {
        "NATS_URL": (),
        "BRIGADE_NATS_USER": None,
        "BRIGADE_NATS_PASSWORD": None,
        "BRIGADE_DATA_DIR": Path(".brigade"),
        "BRIGADE_ARCHIVE_DIR": None,
        "BRIGADE_NATS_MAX_PROCS": 1,  # new: the embedded nats-server on one Go processor
        "BRIGADE_ARCHIVER_PACE_S": 0.5,  # new: the archiver's wait between partial fetches
        "BRIGADE_TENANTS": None,
        "BRIGADE_LEDGER_DB": None,
        "BRIGADE_API_KEY": None,
        "BRIGADE_EVENTS_MAX_AGE_S": 7 * 24 * 3600.0,
        "BRIGADE_STREAM_REPLICAS": 1,
        "BRIGADE_ACK_WAIT_S": None,
        "BRIGADE_MAX_DELIVER": None,
        "BRIGADE_SHUTDOWN_TIMEOUT_S": 10.0,
        "BRIGADE_MAX_SUBMIT_CHARS": 2_000_000,
        "BRIGADE_MODEL": "smollm2-135m",
        "BRIGADE_ENGINE_MODEL": None,
        "BRIGADE_SUMMARY_TIMEOUT_S": 60.0,
        "BRIGADE_SUMMARY_MAX_TOKENS": 128,
        "BRIGADE_RETRIEVAL_DB": None,
        "BRIGADE_RETRIEVAL_OVER_RETRIEVE": 4,
        "BRIGADE_RERANK_TIMEOUT_S": 30.0,
        "BRIGADE_CHUNK_TOKENS": 192,
        "BRIGADE_CHUNK_OVERLAP": 32,
        "BRIGADE_DTYPE": "float32",  # the quality set's targets (brigade bench quality)
        "BRIGADE_DEVICE": "cpu",
        "BRIGADE_KV_CACHE_DTYPE": "auto",
        "BRIGADE_KV_CACHE_BYTES": 1 << 30,
        "BRIGADE_NUM_KV_BLOCKS": None,
        "BRIGADE_MAX_NUM_SEQS": 64,
        "BRIGADE_MAX_NUM_BATCHED_TOKENS": 512,
        "BRIGADE_MAX_MODEL_LEN": None,
        "BRIGADE_BATCH_INVARIANT": False,
        "BRIGADE_PREFIX_CACHING": True,  # the served engine's default; EngineConfig's is off
        "BRIGADE_NUM_SPECULATIVE_TOKENS": 0,
        "BRIGADE_QUANTIZED_GEMV": True,
        "BRIGADE_FUSED_DECODE": True,
        "BRIGADE_SCREENED_HEAD": True,
        "BRIGADE_AMX_PREFILL": True,
        "BRIGADE_STREAM_MAX_COALESCE": 1,
        "BRIGADE_STREAM_FLUSH": "step",
        "BRIGADE_STREAM_LAG_POLL_S": 0.1,
        "BRIGADE_CPU_KERNEL": True,
        "CC": None,
        "GOMP_SPINCOUNT": 100_000,
        "XDG_CACHE_HOME": None,
        "LLAMA_CPP_DIR": None,
        "BRIGADE_ENGINE_CPU_PRIORITY": "batch:19",
        "BRIGADE_BACKGROUND_CPU_PRIORITY": "batch:19",
        "BRIGADE_EDGE_HOST": "127.0.0.1",
        "BRIGADE_EDGE_PORT": 8080,
        "BRIGADE_EDGE_MAX_BODY": 1 << 20,
        "BRIGADE_EDGE_MAX_HEADERS": 16 << 10,
        "BRIGADE_EDGE_HEADER_TIMEOUT_S": 10.0,
        "BRIGADE_EDGE_BODY_TIMEOUT_S": 30.0,
        "BRIGADE_EDGE_MAX_FRAME": 1 << 20,
        "BRIGADE_EDGE_RECONNECT_GRACE_S": 15.0,
        "BRIGADE_EDGE_MAX_WAIT_S": 0.5,
        "BRIGADE_EDGE_BURST_WAIT_S": 1.0,
        "BRIGADE_SWEEP_PERIOD_S": 30.0,
        "BRIGADE_SWEEP_QUEUED_S": 600.0,
        "BRIGADE_SWEEP_ENGINE_S": 1800.0,
        "BRIGADE_SWEEP_GRACE_S": 60.0,
        "BRIGADE_SWEEP_MAX_PER_PASS": 1000,
        "BRIGADE_EDGE_MODEL_ALIASES": (),
        "BRIGADE_EDGE_KV_WATERMARK": 0.95,
        "BRIGADE_EDGE_DEADLINE_S": 300.0,
        "BRIGADE_EDGE_HTTP": "httptools",
        "BRIGADE_EDGE_BATCH_SSE": False,
        "BRIGADE_EDGE_KEEPALIVE_S": 10.0,
        "BRIGADE_SWEEP_EDGE_CHECK_S": 0.25,
        "BRIGADE_SWEEP_EDGE_GRACE_S": 1.0,
    }
    assert {s.name: s.default for s in settings.SETTINGS} == before
    found = settings.load({})
    assert {s.name: found[s] for s in settings.SETTINGS} == before


def test_the_defaults_agree_with_the_configs_they_fill():
    from engine import EngineConfig
    from engine.kv_cache import DEFAULT_KV_CACHE_BYTES
    from stages.edge.admission import AdmissionConfig
    from stages.edge.core import EdgeConfig
    from stages.runtime.bus import BusConfig
    from stages.runtime.spec import StageSpec

    engine = EngineConfig()
    assert (engine.model, engine.dtype, engine.device) == (
        settings.MODEL.default, settings.DTYPE.default, settings.DEVICE.default,
    )  # fmt: skip
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (
        settings.MAX_NUM_SEQS.default, settings.MAX_NUM_BATCHED_TOKENS.default,
    )  # fmt: skip
    assert (engine.batch_invariant, engine.enable_prefix_caching) == (False, False)
    assert engine.num_speculative_tokens == settings.NUM_SPECULATIVE_TOKENS.default
    assert engine.quantized_gemv == settings.QUANTIZED_GEMV.default
    assert engine.fused_decode == settings.FUSED_DECODE.default
    assert engine.screened_head == settings.SCREENED_HEAD.default
    assert engine.amx_prefill == settings.AMX_PREFILL.default
    assert engine.kv_cache_dtype == settings.KV_CACHE_DTYPE.default
    assert DEFAULT_KV_CACHE_BYTES == settings.KV_CACHE_BYTES.default
    from engine.engine import DTYPES, KV_CACHE_DTYPES

    assert set(settings.DTYPE.choices) == set(DTYPES)
    assert set(settings.KV_CACHE_DTYPE.choices) == set(KV_CACHE_DTYPES)
    edge, admission = EdgeConfig(), AdmissionConfig()
    assert (edge.host, edge.port, edge.reconnect_grace_s) == (
        settings.EDGE_HOST.default, settings.EDGE_PORT.default,
        settings.EDGE_RECONNECT_GRACE_S.default,
    )  # fmt: skip
    assert (edge.max_body_bytes, edge.max_header_bytes, edge.max_frame_bytes) == (
        settings.EDGE_MAX_BODY.default, settings.EDGE_MAX_HEADERS.default,
        settings.EDGE_MAX_FRAME.default,
    )  # fmt: skip
    assert (admission.max_wait_s, admission.burst_wait_s, admission.kv_watermark) == (
        settings.EDGE_MAX_WAIT_S.default, settings.EDGE_BURST_WAIT_S.default,
        settings.EDGE_KV_WATERMARK.default,
    )  # fmt: skip
    bus = BusConfig(servers=("nats://x:4222",))
    assert (bus.events_max_age_s, bus.replicas) == (
        settings.EVENTS_MAX_AGE_S.default, settings.STREAM_REPLICAS.default,
    )  # fmt: skip
    spec = StageSpec.__dataclass_fields__
    assert (spec["ack_wait_s"].default, spec["max_deliver"].default) == (30.0, 5)
    assert settings.ACK_WAIT_S.default_text.endswith("30")
    assert settings.MAX_DELIVER.default_text.endswith("5")


def test_the_process_environment_is_read_when_it_changes(monkeypatch):
    monkeypatch.delenv("BRIGADE_EDGE_PORT", raising=False)
    assert settings.EDGE_PORT.get() == 8080
    monkeypatch.setenv("BRIGADE_EDGE_PORT", "9000")
    assert settings.EDGE_PORT.get() == 9000
    assert settings.load() is settings.load()  # parsed once while nothing changes
    monkeypatch.delenv("BRIGADE_EDGE_PORT")
    assert settings.EDGE_PORT.get() == 8080


def test_an_unknown_brigade_variable_is_a_warning_naming_the_closest():
    found = settings.load({"BRIGADE_EDGE_PROT": "9000", "BRIGADE_ZZZ": "1", "OTHER": "x"})
    assert found.check() is found
    assert found.warnings() == [
        "BRIGADE_EDGE_PROT is set but is not a Brigade setting; did you mean BRIGADE_EDGE_PORT?",
        "BRIGADE_ZZZ is set but is not a Brigade setting; `brigade config` lists them",
    ]


def test_a_secret_is_never_shown():
    assert settings.API_KEY.show("brg-secret") == "(set, not shown)"
    assert settings.load({"BRIGADE_API_KEY": "brg-secret"})[settings.API_KEY] == "brg-secret"


def test_every_reader_is_a_known_service_or_tool():
    for name in settings.READERS:
        assert settings.for_reader(name), f"{name} reads no setting"
    assert {s.name for s in settings.for_reader("edge")} >= {"BRIGADE_EDGE_PORT", "NATS_URL"}


def test_no_module_but_settings_reads_the_environment():
    read = re.compile(r"os\.getenv\(|environ\.get\(|environ\[[^\]]+\](?!\s*=[^=])")
    readers = [
        str(path.relative_to(ROOT))
        for package in ("stages", "tools", "engine", "kernels", "schemas")
        for path in sorted((ROOT / package).rglob("*.py"))
        if read.search(path.read_text()) and path != ROOT / "schemas" / "settings.py"
    ]
    assert not readers, f"read these variables through schemas.settings: {readers}"
