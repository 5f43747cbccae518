"""Every environment variable Brigade reads, declared once: name, type, default, help, readers.

`load()` parses the environment into a frozen `Settings`, cached while the environment is
unchanged (so a test's `monkeypatch.setenv` is seen); a bad value is an `InvalidSetting` naming
the variable, an unknown BRIGADE_* name a warning that names the closest declared one.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")
Kind = Literal["bool", "int", "float", "str", "path", "csv"]
Source = Literal["env", "default"]
PREFIX = "BRIGADE_"

SERVICES = (
    "gateway", "auth", "context", "tokenize", "engine", "detokenize", "ledger", "edge", "archiver",
    "ingest", "sweeper",
)  # fmt: skip
TOOLS = (
    "up",
    "ask",
    "status",
    "keys",
    "usage",
    "log",
    "bench",
    "docs",
)  # log: sql, report, trace, replay
READERS = SERVICES + TOOLS
WORKERS = ("gateway", "auth", "context", "tokenize", "engine", "detokenize", "ledger", "ingest")
BUS_USERS = (*SERVICES, "up", "ask", "status", "log", "bench")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_CPU_PRIORITY = re.compile(r"^\s*(idle|normal|batch|(batch|nice):0*1?\d)\s*$", re.IGNORECASE)


class InvalidSetting(ValueError):
    """A variable whose value cannot be used: `name` is the variable, `problem` what is wrong."""

    def __init__(self, setting: Setting[Any], text: str, problem: str) -> None:
        self.name, self.value, self.problem = setting.name, text, problem
        super().__init__(
            f"{setting.name}={text!r}: {problem} ({setting.help}; default {setting.default_str()})"
        )


class InvalidSettings(ValueError):
    """Every invalid variable of one environment, one line each."""

    def __init__(self, errors: tuple[InvalidSetting, ...]) -> None:
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


@dataclass(frozen=True, kw_only=True)
class Setting(Generic[T]):
    """One variable. `default` None means "unset", described by `default_text`; `ge`/`gt`/`le`
    bound numbers, `choices` lists the allowed values; `secret` values are never printed."""

    name: str
    kind: Kind
    default: T
    help: str
    readers: tuple[str, ...]
    default_text: str | None = None
    choices: tuple[Any, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    pattern: re.Pattern[str] | None = None
    allowed: str | None = None  # what `pattern` accepts, in words
    secret: bool = False

    def __post_init__(self) -> None:
        assert self.name == self.name.upper(), f"{self.name}: variables are upper case"
        assert set(self.readers) <= set(READERS), f"{self.name}: unknown readers {self.readers}"
        assert self.default is not None or self.default_text, f"{self.name}: say what unset means"
        assert "|" not in self.help + (self.default_text or ""), (
            f"{self.name}: '|' breaks the table"
        )

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in `environ` (default: this process's environment)."""
        return load(environ)[self]

    def parse(self, text: str) -> T:
        """The typed value of `text`; InvalidSetting naming the variable when it is not one."""
        value: Any
        if self.kind == "bool":
            if text.strip().lower() not in _TRUE + _FALSE:
                raise InvalidSetting(
                    self, text, f"{text!r} is not a flag; allowed: 1/0, true/false, yes/no, on/off"
                )
            value = text.strip().lower() in _TRUE
        elif self.kind == "int":
            try:
                value = int(text)
            except ValueError:
                raise InvalidSetting(self, text, "not an integer") from None
        elif self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise InvalidSetting(self, text, "not a number") from None
        elif self.kind == "path":
            value = Path(text)
        elif self.kind == "csv":
            value = tuple(part.strip() for part in text.split(",") if part.strip())
        else:
            value = text
        self._check(text, value)
        return value

    def _check(self, text: str, value: Any) -> None:
        if self.choices and value not in self.choices:
            raise InvalidSetting(self, text, f"allowed: {self.allowed_str()}")
        if self.pattern is not None and not self.pattern.match(text):
            raise InvalidSetting(self, text, f"allowed: {self.allowed_str()}")
        if self.kind in ("int", "float") and not self._in_range(value):
            raise InvalidSetting(self, text, f"allowed: {self.allowed_str()}")

    def _in_range(self, value: float) -> bool:
        return not (
            value != value  # NaN
            or (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        )

    def allowed_str(self) -> str:
        """The allowed values in words: '1, 3 or 5', '>= 1', '> 0 and <= 1'."""
        if self.choices:
            names = [str(c) for c in self.choices]
            return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
        if self.allowed:
            return self.allowed
        bounds = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt)) if v is not None]
        bounds += [f"<= {_num(self.le)}"] if self.le is not None else []
        return " and ".join(bounds) if bounds else ("1/0" if self.kind == "bool" else "any")

    def type_str(self) -> str:
        kind = {"bool": "flag", "csv": "list"}.get(self.kind, self.kind)
        return kind if self.allowed_str() in ("any", "1/0") else f"{kind}: {self.allowed_str()}"

    def default_str(self) -> str:
        return self.default_text or self.show(self.default)

    def show(self, value: Any) -> str:
        """A value as it would be written in the environment."""
        if value is None:
            return ""
        if self.secret:
            return "(set, not shown)"
        if self.kind == "bool":
            return "1" if value else "0"
        if self.kind == "csv":
            return ",".join(value)
        if self.kind == "float":
            return _num(value)
        return str(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


SETTINGS: list[Setting[Any]] = []


def declare(setting: Setting[T]) -> Setting[T]:
    assert setting.name not in {s.name for s in SETTINGS}, f"{setting.name} declared twice"
    SETTINGS.append(setting)
    return setting


# Where things are
NATS_URL = declare(Setting[tuple[str, ...]](
    name="NATS_URL", kind="csv", default=(),
    default_text="the private server of a running `brigade up`",
    help="NATS server URLs, comma-separated for a cluster",
    readers=BUS_USERS,
))  # fmt: skip
NATS_USER = declare(Setting[str | None](
    name="BRIGADE_NATS_USER", kind="str", default=None, default_text="none (no authentication)",
    help="NATS user this service connects as (deploy/nats/brigade.conf: one per stage, admin)",
    readers=BUS_USERS,
))  # fmt: skip
NATS_PASSWORD = declare(Setting[str | None](
    name="BRIGADE_NATS_PASSWORD", kind="str", default=None, default_text="none",
    help="password of BRIGADE_NATS_USER", readers=BUS_USERS, secret=True,
))  # fmt: skip
DATA_DIR = declare(Setting[Path](
    name="BRIGADE_DATA_DIR", kind="path", default=Path(".brigade"),
    help="`brigade up`'s NATS data and state file; tenants, ledger and archive by default",
    readers=READERS,
))  # fmt: skip
ARCHIVE_DIR = declare(Setting[Path | None](
    name="BRIGADE_ARCHIVE_DIR", kind="path", default=None,
    default_text="$BRIGADE_DATA_DIR/archive",
    help="the event log's Parquet files: the archiver writes them, the log tools read them",
    readers=("archiver", "log"),
))  # fmt: skip
NATS_MAX_PROCS = declare(Setting[int](
    name="BRIGADE_NATS_MAX_PROCS", kind="int", default=1, ge=0,
    help="GOMAXPROCS of the nats-server `brigade up` starts (0: Go's default, every CPU); one "
    "keeps its wake-ups, and the engine threads they preempt, to half on two cores. GOMAXPROCS "
    "set in the environment wins",
    readers=("up", "bench"),
))  # fmt: skip
ARCHIVER_PACE_S = declare(Setting[float](
    name="BRIGADE_ARCHIVER_PACE_S", kind="float", default=0.5, ge=0, le=4.0,
    help="seconds the archiver waits after a fetch that found less than a batch, so what the "
    "log stores meanwhile comes in one delivery, not a wake-up every few events",
    readers=("archiver",),
))  # fmt: skip
TENANTS = declare(Setting[Path | None](
    name="BRIGADE_TENANTS", kind="path", default=None,
    default_text="$BRIGADE_DATA_DIR/tenants.toml",
    help="tenants file: API key hashes, limits, allowed models; the dev key is saved beside it",
    readers=("auth", "edge", "up", "ask", "keys", "log", "bench"),
))  # fmt: skip
LEDGER_DB = declare(Setting[Path | None](
    name="BRIGADE_LEDGER_DB", kind="path", default=None,
    default_text="$BRIGADE_DATA_DIR/ledger.duckdb",
    help="DuckDB file of billed usage",
    readers=("ledger", "usage"),
))  # fmt: skip
API_KEY = declare(Setting[str | None](
    name="BRIGADE_API_KEY", kind="str", default=None,
    default_text="the key `brigade up` saved, else a new one",
    help="the dev tenant's API key for `brigade up`, `ask`, `replay --rerun`, `bench load` and "
    "`bench serve --url`",
    readers=("up", "ask", "log", "bench"), secret=True,
))  # fmt: skip

# The bus
EVENTS_MAX_AGE_S = declare(Setting[float](
    name="BRIGADE_EVENTS_MAX_AGE_S", kind="float", default=7 * 24 * 3600.0, gt=0,
    help="seconds the event stream keeps an event",
    readers=BUS_USERS,
))  # fmt: skip
STREAM_REPLICAS = declare(Setting[int](
    name="BRIGADE_STREAM_REPLICAS", kind="int", default=1, choices=(1, 3, 5),
    help="replicas of each stream and bucket; 3 for an R3 cluster",
    readers=BUS_USERS,
))  # fmt: skip
ACK_WAIT_S = declare(Setting[float | None](
    name="BRIGADE_ACK_WAIT_S", kind="float", default=None, gt=0,
    default_text="each stage's own, 30",
    help="seconds before an unacked message is redelivered, for every stage",
    readers=WORKERS,
))  # fmt: skip
MAX_DELIVER = declare(Setting[int | None](
    name="BRIGADE_MAX_DELIVER", kind="int", default=None, ge=1,
    default_text="each stage's own, 5",
    help="deliveries of one message before a stage gives up on it, for every stage",
    readers=WORKERS,
))  # fmt: skip
SHUTDOWN_TIMEOUT_S = declare(Setting[float](
    name="BRIGADE_SHUTDOWN_TIMEOUT_S", kind="float", default=10.0, gt=0,
    help="seconds `brigade up` gives its stages to drain on Ctrl-C before it kills what is left",
    readers=("up",),
))  # fmt: skip

# The request's path
MAX_SUBMIT_CHARS = declare(Setting[int](
    name="BRIGADE_MAX_SUBMIT_CHARS", kind="int", default=2_000_000, ge=1,
    help="characters of one submit's messages, system prompt and documents together",
    readers=("gateway", "edge"),
))  # fmt: skip
MODEL = declare(Setting[str](
    name="BRIGADE_MODEL", kind="str", default="smollm2-135m",
    help="the served models, comma-separated, the default first: each a registered name, a "
    ".gguf file or a Hugging Face directory, as `id=model` to name it (schemas/models.py)",
    readers=("gateway", "context", "tokenize", "engine", "detokenize", "edge", "ingest", "up",
             "bench"),
    pattern=re.compile(r"^\s*[^,=]+(=[^,=]+)?(\s*,\s*[^,=]+(=[^,=]+)?)*\s*,?\s*$"),
    allowed="comma-separated `model` or `id=model`",
))  # fmt: skip
ENGINE_MODEL = declare(Setting[str | None](
    name="BRIGADE_ENGINE_MODEL", kind="str", default=None,
    default_text="the first of BRIGADE_MODEL",
    help="the one model this engine worker serves and announces: an id of BRIGADE_MODEL",
    readers=("engine",),
))  # fmt: skip
SUMMARY_TIMEOUT_S = declare(Setting[float](
    name="BRIGADE_SUMMARY_TIMEOUT_S", kind="float", default=60.0, gt=0,
    help="seconds the context stage waits for a summary of dropped history",
    readers=("context",),
))  # fmt: skip
SUMMARY_MAX_TOKENS = declare(Setting[int](
    name="BRIGADE_SUMMARY_MAX_TOKENS", kind="int", default=128, ge=1,
    help="most tokens of a summary of dropped history",
    readers=("context",),
))  # fmt: skip

# Retrieval
RETRIEVAL_DB = declare(Setting[Path | None](
    name="BRIGADE_RETRIEVAL_DB", kind="path", default=None,
    default_text="$BRIGADE_DATA_DIR/retrieval.duckdb",
    help="DuckDB file of the tenants' document collections, chunks and vectors",
    readers=("context", "ingest", "edge", "docs", "bench"),
))  # fmt: skip
RETRIEVAL_OVER_RETRIEVE = declare(Setting[int](
    name="BRIGADE_RETRIEVAL_OVER_RETRIEVE", kind="int", default=4, ge=1, le=16,
    help="candidates searched per kept chunk (top_k x this), unless a request sets over_retrieve",
    readers=("context",),
))  # fmt: skip
RERANK_TIMEOUT_S = declare(Setting[float](
    name="BRIGADE_RERANK_TIMEOUT_S", kind="float", default=30.0, gt=0,
    help="seconds the context stage waits for the served model to score the candidates",
    readers=("context",),
))  # fmt: skip
CHUNK_TOKENS = declare(Setting[int](
    name="BRIGADE_CHUNK_TOKENS", kind="int", default=192, ge=16, le=1024,
    help="most tokens of the served model in one chunk of an ingested document",
    readers=("ingest", "docs", "bench"),
))  # fmt: skip
CHUNK_OVERLAP = declare(Setting[int](
    name="BRIGADE_CHUNK_OVERLAP", kind="int", default=32, ge=0, le=512,
    help="tokens a chunk repeats of the one before it (whole paragraphs, or a long one's window)",
    readers=("ingest", "docs", "bench"),
))  # fmt: skip

# The engine
DTYPE = declare(Setting[str](
    name="BRIGADE_DTYPE", kind="str", default="float32",
    choices=("float32", "bfloat16", "float16"),
    help="dtype of the engine's weights (and of its KV cache, unless BRIGADE_KV_CACHE_DTYPE)",
    readers=("engine",),
))  # fmt: skip
KV_CACHE_DTYPE = declare(Setting[str](
    name="BRIGADE_KV_CACHE_DTYPE", kind="str", default="auto",
    choices=("auto", "float32", "bfloat16", "float16"),
    help="element type of the engine's KV cache: `auto`, the model's dtype; `float16` under the "
    "float32 model on the CPU: K and V rounded to fp16 as they are stored (half the bytes a step "
    "reads, twice the tokens a budget holds)",
    readers=("engine",),
))  # fmt: skip
DEVICE = declare(Setting[str](
    name="BRIGADE_DEVICE", kind="str", default="cpu",
    help="torch device of the engine: cpu, cuda, cuda:1",
    readers=("engine",),
))  # fmt: skip
KV_CACHE_BYTES = declare(Setting[int](
    name="BRIGADE_KV_CACHE_BYTES", kind="int", default=1 << 30, ge=1,
    help="bytes of KV cache the engine allocates",
    readers=("engine",),
))  # fmt: skip
NUM_KV_BLOCKS = declare(Setting[int | None](
    name="BRIGADE_NUM_KV_BLOCKS", kind="int", default=None, ge=1,
    default_text="from BRIGADE_KV_CACHE_BYTES",
    help="KV cache blocks, instead of a byte budget",
    readers=("engine",),
))  # fmt: skip
MAX_NUM_SEQS = declare(Setting[int](
    name="BRIGADE_MAX_NUM_SEQS", kind="int", default=64, ge=1,
    help="sequences the engine runs in one step at most",
    readers=("engine",),
))  # fmt: skip
MAX_NUM_BATCHED_TOKENS = declare(Setting[int](
    name="BRIGADE_MAX_NUM_BATCHED_TOKENS", kind="int", default=512, ge=1,
    help="tokens the engine computes in one step at most, prefill chunks included",
    readers=("engine",),
))  # fmt: skip
MAX_MODEL_LEN = declare(Setting[int | None](
    name="BRIGADE_MAX_MODEL_LEN", kind="int", default=None, ge=1,
    default_text="the model's context length",
    help="tokens of prompt and output of one request; context and engine must agree",
    readers=("context", "engine", "edge"),
))  # fmt: skip
BATCH_INVARIANT = declare(Setting[bool](
    name="BRIGADE_BATCH_INVARIANT", kind="bool", default=False,
    help="bit-identical logits whatever shares a step, chunks a prompt or continues a run "
    "(CPU: float32 on a GGUF's Q4_1/Q8_0 blocks, or bfloat16)",
    readers=("engine",),
))  # fmt: skip
PREFIX_CACHING = declare(Setting[bool](
    name="BRIGADE_PREFIX_CACHING", kind="bool", default=True,
    help="reuse the K/V of full blocks a prompt shares with earlier ones of the same tenant "
    "(the engine stage's default; the offline EngineConfig's is off)",
    readers=("engine",),
))  # fmt: skip
NUM_SPECULATIVE_TOKENS = declare(Setting[int](
    name="BRIGADE_NUM_SPECULATIVE_TOKENS", kind="int", default=0, ge=0,
    help="n-gram draft tokens per step for greedy requests; 0 is off",
    readers=("engine",),
))  # fmt: skip
STREAM_MAX_COALESCE = declare(Setting[int](
    name="BRIGADE_STREAM_MAX_COALESCE", kind="int", default=1, ge=1,
    help="tokens one `tokens` event may carry while detokenize lags (a backlog past one step's "
    "events); 1, the default: always one (coalescing measured slower, docs/benchmarks.md)",
    readers=("engine",),
))  # fmt: skip
STREAM_FLUSH = declare(Setting[str](
    name="BRIGADE_STREAM_FLUSH", kind="str", default="step", choices=("step", "event"),
    help="when the engine stage lets its `tokens` events out to NATS: `step` (the default), a "
    "step's events together in one write; `event`, each as it is published (a write each; "
    "measured slower, docs/benchmarks.md)",
    readers=("engine",),
))  # fmt: skip
STREAM_LAG_POLL_S = declare(Setting[float](
    name="BRIGADE_STREAM_LAG_POLL_S", kind="float", default=0.1, gt=0,
    help="how often the engine stage samples detokenize's backlog",
    readers=("engine",),
))  # fmt: skip
QUANTIZED_GEMV = declare(Setting[bool](
    name="BRIGADE_QUANTIZED_GEMV", kind="bool", default=True,
    help="fp32 GGUF linears read the Q4_1/Q8_0 blocks (a GEMV up to 32 rows, a GEMM above); "
    "0: dense fp32 weights",
    readers=("engine",),
))  # fmt: skip
FUSED_DECODE = declare(Setting[bool](
    name="BRIGADE_FUSED_DECODE", kind="bool", default=True,
    help="fp32 GGUF steps of <= 32 tokens run every layer in one C call (kernels/cpu_decode.py); "
    "0: layer by layer in torch",
    readers=("engine",),
))  # fmt: skip
SCREENED_HEAD = declare(Setting[bool](
    name="BRIGADE_SCREENED_HEAD", kind="bool", default=True,
    help="greedy rows of a Q8_0 LM head: an int8 screen, then fp32 logits for the tokens it "
    "leaves, the same tokens (kernels/cpu_greedy_head.py; AVX-512 VNNI, or AMX int8 tiles where "
    "they run); 0: the whole fp32 head",
    readers=("engine",),
))  # fmt: skip
AMX_PREFILL = declare(Setting[bool](
    name="BRIGADE_AMX_PREFILL", kind="bool", default=True,
    help="fp32 Q4_1 steps of more than 32 rows (prefill) run their GEMMs on AMX bf16 tiles, "
    "the weights split exactly into bf16 pieces, x into two (16 bits), fp32 sums "
    "(kernels/cpu_amx_gemm.py), where AMX works; 0: the AVX-512 / AVX2 block GEMM, exact fp32",
    readers=("engine",),
))  # fmt: skip
CPU_KERNEL = declare(Setting[bool](
    name="BRIGADE_CPU_KERNEL", kind="bool", default=True,
    help="the compiled CPU attention kernels (paged attention; fp32 causal prefill chunks on "
    "GGUF blocks); 0: the pure-torch reference and torch's SDPA",
    readers=("engine", "bench"),
))  # fmt: skip
CC = declare(Setting[str | None](
    name="CC", kind="str", default=None, default_text="cc, else gcc",
    help="C compiler that builds the CPU kernels (attention, quantized GEMV and GEMM, the fused "
    "decode forward)",
    readers=("engine", "bench"),
))  # fmt: skip
GOMP_SPINCOUNT = declare(Setting[int](
    name="GOMP_SPINCOUNT", kind="int", default=100_000, ge=0,
    help="spins an idle OpenMP thread (torch's CPU pool) waits before it sleeps; libgomp's own "
    "300k starves the stages sharing the cores, 0 halves idle single-stream decode; unset when "
    "OMP_WAIT_POLICY is given; read once, when torch loads",
    readers=("engine", "bench"),
))  # fmt: skip
XDG_CACHE_HOME = declare(Setting[Path | None](
    name="XDG_CACHE_HOME", kind="path", default=None, default_text="~/.cache",
    help="cache root; the built CPU kernels live in its brigade/kernels",
    readers=("engine", "bench"),
))  # fmt: skip
LLAMA_CPP_DIR = declare(Setting[Path | None](
    name="LLAMA_CPP_DIR", kind="path", default=None,
    default_text="built from the llama-cpp-python sdist under $BRIGADE_DATA_DIR/llama.cpp",
    help="a built llama.cpp (build/bin, bin or the folder itself) that `brigade bench peer` runs",
    readers=("bench",),
))  # fmt: skip
_PRIORITY_WORDS = "idle, batch, batch:N, nice:N or normal (N in 0..19)"
ENGINE_CPU_PRIORITY = declare(Setting[str](
    name="BRIGADE_ENGINE_CPU_PRIORITY", kind="str", default="batch:19",
    pattern=_CPU_PRIORITY, allowed=_PRIORITY_WORDS,
    help="CPU priority of the engine's step thread and the torch threads it starts",
    readers=("engine",),
))  # fmt: skip
BACKGROUND_CPU_PRIORITY = declare(Setting[str](
    name="BRIGADE_BACKGROUND_CPU_PRIORITY", kind="str", default="batch:19",
    pattern=_CPU_PRIORITY, allowed=_PRIORITY_WORDS,
    help="CPU priority of the ledger, archiver and ingest processes, off the request's path",
    readers=("ledger", "archiver", "ingest"),
))  # fmt: skip

# The edge (HTTP and websocket)
EDGE_HOST = declare(Setting[str](
    name="BRIGADE_EDGE_HOST", kind="str", default="127.0.0.1",
    help="address the edge listens on",
    readers=("edge",),
))  # fmt: skip
EDGE_PORT = declare(Setting[int](
    name="BRIGADE_EDGE_PORT", kind="int", default=8080, ge=1, le=65535,
    help="port the edge listens on",
    readers=("edge", "up"),
))  # fmt: skip
EDGE_MAX_BODY = declare(Setting[int](
    name="BRIGADE_EDGE_MAX_BODY", kind="int", default=1 << 20, ge=1,
    help="bytes of one HTTP request body",
    readers=("edge",),
))  # fmt: skip
EDGE_MAX_HEADERS = declare(Setting[int](
    name="BRIGADE_EDGE_MAX_HEADERS", kind="int", default=16 << 10, ge=1,
    help="bytes of one request's headers",
    readers=("edge",),
))  # fmt: skip
EDGE_HEADER_TIMEOUT_S = declare(Setting[float](
    name="BRIGADE_EDGE_HEADER_TIMEOUT_S", kind="float", default=10.0, gt=0,
    help="seconds a connection may take to send a request's headers before it gets 408",
    readers=("edge",),
))  # fmt: skip
EDGE_BODY_TIMEOUT_S = declare(Setting[float](
    name="BRIGADE_EDGE_BODY_TIMEOUT_S", kind="float", default=30.0, gt=0,
    help="seconds a request's body may take after its headers before it gets 408",
    readers=("edge",),
))  # fmt: skip
EDGE_MAX_FRAME = declare(Setting[int](
    name="BRIGADE_EDGE_MAX_FRAME", kind="int", default=1 << 20, ge=1,
    help="characters of one websocket frame",
    readers=("edge",),
))  # fmt: skip
EDGE_RECONNECT_GRACE_S = declare(Setting[float](
    name="BRIGADE_EDGE_RECONNECT_GRACE_S", kind="float", default=15.0, ge=0,
    help="seconds a dropped run with an idempotency key waits for its client to come back",
    readers=("edge", "sweeper"),
))  # fmt: skip
EDGE_MAX_WAIT_S = declare(Setting[float](
    name="BRIGADE_EDGE_MAX_WAIT_S", kind="float", default=0.5, gt=0,
    help="estimated seconds to a first token (the waiting runs ahead, then its prefill) past "
    "which the edge answers 503 while runs wait",
    readers=("edge",),
))  # fmt: skip
EDGE_BURST_WAIT_S = declare(Setting[float](
    name="BRIGADE_EDGE_BURST_WAIT_S", kind="float", default=1.0, gt=0,
    help="the same bound for a burst that finds the edge quiet (nothing refused for 10 s) and "
    "for a refused request sent again at its retry time, never below BRIGADE_EDGE_MAX_WAIT_S: "
    "a burst's tail, refused, would only wait later",
    readers=("edge",),
))  # fmt: skip
EDGE_MODEL_ALIASES = declare(Setting[tuple[str, ...]](
    name="BRIGADE_EDGE_MODEL_ALIASES", kind="csv", default=(), default_text="none",
    help="other names the edge accepts in `model`, comma-separated: `alias` (for the default "
    "model) or `alias=id` (for the served model of that id)",
    readers=("edge",),
))  # fmt: skip
EDGE_KV_WATERMARK = declare(Setting[float](
    name="BRIGADE_EDGE_KV_WATERMARK", kind="float", default=0.95, gt=0, le=1,
    help="KV cache use, 0..1, above which the edge answers 429 while requests queue",
    readers=("edge",),
))  # fmt: skip
EDGE_DEADLINE_S = declare(Setting[float](
    name="BRIGADE_EDGE_DEADLINE_S", kind="float", default=300.0, gt=0, le=86_400,
    help="seconds a request may wait for its first token (for an engine) before it is "
    "cancelled, unless the request (X-Brigade-Deadline-S, `deadline_s`) or its tenant "
    "(`deadline_s` in tenants.toml) sets its own",
    readers=("edge",),
))  # fmt: skip
EDGE_HTTP = declare(Setting[str](
    name="BRIGADE_EDGE_HTTP", kind="str", default="httptools", choices=("httptools", "h11"),
    help="the edge's HTTP/1.1 parser and writer, one of uvicorn's protocols (the header, body "
    "and timeout bounds hold on both): httptools, its C parser, or h11, pure Python",
    readers=("edge",),
))  # fmt: skip
EDGE_BATCH_SSE = declare(Setting[bool](
    name="BRIGADE_EDGE_BATCH_SSE", kind="bool", default=False,
    help="an SSE answer's chunks that are ready together leave in one write (a lagging edge "
    "writes fewer, larger chunks); off: one write per chunk",
    readers=("edge",),
))  # fmt: skip
EDGE_KEEPALIVE_S = declare(Setting[float](
    name="BRIGADE_EDGE_KEEPALIVE_S", kind="float", default=10.0, gt=0,
    help="seconds of silence before a waiting stream gets a keep-alive (an SSE `: keep-alive` "
    "comment, a websocket `response.waiting` event); an SSE answer with no first event by then "
    "starts (200) and waits in the stream",
    readers=("edge",),
))  # fmt: skip

# The sweeper (runs that nothing ended past their deadline)
SWEEP_PERIOD_S = declare(Setting[float](
    name="BRIGADE_SWEEP_PERIOD_S", kind="float", default=30.0, gt=0,
    help="seconds between the sweeper's passes over the run-state projection",
    readers=("sweeper",),
))  # fmt: skip
SWEEP_QUEUED_S = declare(Setting[float](
    name="BRIGADE_SWEEP_QUEUED_S", kind="float", default=600.0, gt=0,
    help="seconds a run before the engine (accepted .. assembled) may show no progress before "
    "the sweeper cancels it",
    readers=("sweeper",),
))  # fmt: skip
SWEEP_ENGINE_S = declare(Setting[float](
    name="BRIGADE_SWEEP_ENGINE_S", kind="float", default=1800.0, gt=0,
    help="seconds a run in the engine (tokenized, streaming) may go without a `tokens` event "
    "before the sweeper cancels it",
    readers=("sweeper",),
))  # fmt: skip
SWEEP_GRACE_S = declare(Setting[float](
    name="BRIGADE_SWEEP_GRACE_S", kind="float", default=60.0, ge=0,
    help="seconds after its cancel before the sweeper ends a run nothing else ended",
    readers=("sweeper",),
))  # fmt: skip
SWEEP_MAX_PER_PASS = declare(Setting[int](
    name="BRIGADE_SWEEP_MAX_PER_PASS", kind="int", default=1000, ge=1,
    help="runs the sweeper cancels or ends in one pass at most",
    readers=("sweeper",),
))  # fmt: skip
SWEEP_EDGE_CHECK_S = declare(Setting[float](
    name="BRIGADE_SWEEP_EDGE_CHECK_S", kind="float", default=0.25, gt=0,
    help="seconds between the sweeper's checks that each edge worker following runs is still "
    "connected",
    readers=("sweeper",),
))  # fmt: skip
SWEEP_EDGE_GRACE_S = declare(Setting[float](
    name="BRIGADE_SWEEP_EDGE_GRACE_S", kind="float", default=1.0, ge=0,
    help="seconds an edge worker may be unreachable before the sweeper cancels the runs it "
    "followed (runs with an idempotency key: BRIGADE_EDGE_RECONNECT_GRACE_S later, unless "
    "another edge follows them by then)",
    readers=("sweeper",),
))  # fmt: skip

BY_NAME: Mapping[str, Setting[Any]] = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Value:
    setting: Setting[Any]
    value: Any
    source: Source
    error: InvalidSetting | None = None


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The parsed environment: a value (or its error) and its source for every setting."""

    values: Mapping[str, Value]
    unknown: tuple[str, ...] = ()  # BRIGADE_* names in the environment that are not declared
    errors: tuple[InvalidSetting, ...] = field(init=False)

    def __post_init__(self) -> None:
        found = tuple(v.error for v in self.values.values() if v.error is not None)
        object.__setattr__(self, "errors", found)

    def __getitem__(self, setting: Setting[T]) -> T:
        found = self.values[setting.name]
        if found.error is not None:
            raise found.error
        return found.value

    def source(self, setting: Setting[Any]) -> Source:
        return self.values[setting.name].source

    def check(self) -> Settings:
        """Self, or InvalidSettings listing every variable that has a bad value."""
        if self.errors:
            raise InvalidSettings(self.errors)
        return self

    def warnings(self) -> list[str]:
        """One line per unknown BRIGADE_* variable, naming the closest declared one."""
        lines = []
        tails = {n.removeprefix(PREFIX): n for n in BY_NAME}  # the shared prefix is no likeness
        for name in self.unknown:
            close = difflib.get_close_matches(name.removeprefix(PREFIX), tails, n=1, cutoff=0.6)
            guess = f"did you mean {tails[close[0]]}?" if close else "`brigade config` lists them"
            lines.append(f"{name} is set but is not a Brigade setting; {guess}")
        return lines


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of `environ` (default: os.environ); never raises (see `Settings.check`).
    An empty value counts as unset."""
    env = os.environ if environ is None else environ
    relevant = tuple(sorted((k, v) for k, v in env.items() if k in BY_NAME or k.startswith(PREFIX)))
    return _parse(relevant)


@functools.lru_cache(maxsize=16)
def _parse(items: tuple[tuple[str, str], ...]) -> Settings:
    env = dict(items)
    values: dict[str, Value] = {}
    for setting in SETTINGS:
        text = env.get(setting.name, "")
        if not text:
            values[setting.name] = Value(setting, setting.default, "default")
            continue
        try:
            values[setting.name] = Value(setting, setting.parse(text), "env")
        except InvalidSetting as err:
            values[setting.name] = Value(setting, None, "env", err)
    unknown = tuple(k for k in env if k.startswith(PREFIX) and k not in BY_NAME)
    return Settings(values=values, unknown=unknown)


def for_reader(name: str) -> list[Setting[Any]]:
    return [s for s in SETTINGS if name in s.readers]


def readers_str(readers: tuple[str, ...]) -> str:
    if set(SERVICES) <= set(readers):
        rest = [r for r in readers if r not in SERVICES]
        return ", ".join(["every service", *rest])
    return ", ".join(readers)


def markdown_table() -> str:
    """The README's table of every setting (`brigade config --markdown`)."""
    lines = ["| variable | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        default = s.default_text or f"`{s.show(s.default)}`"
        lines.append(
            f"| `{s.name}` | {s.type_str()} | {default} | {readers_str(s.readers)} | {s.help} |"
        )
    return "\n".join(lines) + "\n"
