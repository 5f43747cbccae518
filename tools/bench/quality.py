"""`brigade bench quality`: the fixed quality set, every user-selectable configuration in one table.

Teacher-forced over a public-domain corpus (tools/bench/quality_data/) against the plain fp32
reference (quality_reference.py): mean KL(reference || config), top-1 agreement and perplexity,
on the prefill path (the corpus in segments of 512 tokens, each prefilled in one 512-row step,
so the GEMMs of a prompt's prefill run, AMX's where it works) and on the decode path, twice:
the corpus's 32 segments 8 streams at a time, one token each per step (the row count at which
the "-decode" kinds run their GEMVs; with speculation, 2 streams verifying 1 + k tokens each), and
all 32 at once (the fused decode forward's most rows, which at AVX-512 take the rows as vector
lanes; with speculation 8 streams of 1 + k). Then 64 fixed chat prompts
answered greedily through the engine, up to 32 running at once (so the steps reach the fused
forward's vector lanes as a loaded server's do; --quick asks 32 of them), compared with the fp32
engine's answers: answers identical, the first position where a differing one departs, and
there the fp32 reference's own margin between the two tokens (how near a tie the flip was).
llama.cpp's greedy answers to the same prompts are added with --llama-cpp-dir. Writes
quality.md and quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

DATA = Path(__file__).with_name("quality_data")
CORPUS = DATA / "persuasion_ch1-3.txt"
PROMPTS = DATA / "chat_prompts.json"
TARGET_TOP1 = 0.99  # teacher-forced agreement with fp32, every path
TARGET_KL = 0.001  # mean KL(fp32 || config) per token, every path
PREFILL_CHUNK = 512
DECODE_STREAMS = 8
WIDE_STREAMS = 32  # the fused decode forward's most rows (kernels/cpu_decode.py MAX_ROWS)
PATHS = ("prefill", "decode", "decode_wide")
CHAT_STREAMS = WIDE_STREAMS  # chats running at once: a full batch reaches the lanes (>= 28 rows)
QUICK_PROMPTS = WIDE_STREAMS
SPEC_TOKENS = 3


@dataclass(frozen=True)
class QualityConfig:
    """One row of the table: EngineConfig fields that change what the model computes."""

    name: str
    dtype: str = "float32"
    quantization: str | None = None
    batch_invariant: bool = False
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = False
    quantized_gemv: bool = True  # fp32 GGUF decode on the Q4_1 / Q8_0 blocks (gguf_linear.py)
    fused_decode: bool = True  # and its steps of <= 32 tokens in one C call (cpu_decode.py)
    kv_cache_dtype: str = "auto"  # the model's dtype, or float16 under float32
    amx_prefill: bool = True  # steps past 32 rows on AMX tiles, where AMX runs (cpu_amx_gemm.py)
    engine_kwargs: dict = field(default_factory=dict)

    @property
    def engine_fields(self) -> dict:
        return {
            "dtype": self.dtype,
            "quantization": self.quantization,
            "batch_invariant": self.batch_invariant,
            "num_speculative_tokens": self.num_speculative_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
            "quantized_gemv": self.quantized_gemv,
            "fused_decode": self.fused_decode,
            "kv_cache_dtype": self.kv_cache_dtype,
            "amx_prefill": self.amx_prefill,
        }


def all_configs() -> list[QualityConfig]:
    """The default first, then every dtype x weight kind, batch-invariant, speculation, prefix."""
    from kernels import cpu_amx_gemm

    default = _default_fields()
    label = f"{default['dtype']} {default['quantization'] or 'dense'}"
    amx = cpu_amx_gemm.available() and default["amx_prefill"]
    if default["quantized_gemv"] and default["dtype"] == "float32" and not default["quantization"]:
        label += " + GGUF blocks: GEMV up to 32 rows, GEMM above"
        label += " (AMX, x to 16 bits)" if amx else ""
        if default["fused_decode"]:
            label += "; steps up to 32 tokens fused"
    if default["kv_cache_dtype"] != "auto":
        label += f"; {default['kv_cache_dtype']} KV cache"
    rows = [QualityConfig(f"default ({label})", **default)]
    rows.append(QualityConfig("float32 GGUF blocks, layer by layer (fused decode off)",
                              **{**default, "fused_decode": False}))  # fmt: skip
    if amx:  # where AMX runs, the GEMM it replaces is a row of its own
        rows.append(QualityConfig("float32 GGUF blocks, AVX-512 GEMM above 32 rows (AMX off)",
                                  **{**default, "amx_prefill": False}))  # fmt: skip
    for kv in ("auto", "float16"):
        if kv != default["kv_cache_dtype"]:
            name = f"float32 GGUF blocks, {'fp32' if kv == 'auto' else kv} KV cache"
            rows.append(QualityConfig(name, **{**default, "kv_cache_dtype": kv}))
            rows.append(QualityConfig(f"{name}, layer by layer",
                        **{**default, "kv_cache_dtype": kv, "fused_decode": False}))  # fmt: skip
    for dtype in ("float32", "bfloat16", "float16"):
        rows.append(QualityConfig(f"{dtype} dense", dtype=dtype))
    rows.append(QualityConfig("float32 dense (dense decode)", quantized_gemv=False))
    for q in ("int4-decode", "int8-decode", "int4", "int8"):
        rows.append(QualityConfig(f"bfloat16 {q}", dtype="bfloat16", quantization=q))
    rows.append(QualityConfig("float32 batch-invariant (GGUF blocks: GEMV at every row count)",
                              batch_invariant=True))  # fmt: skip
    for q in (None, "int4", "int8"):
        name = f"bfloat16 {q or 'dense'} batch-invariant"
        rows.append(QualityConfig(name, dtype="bfloat16", quantization=q, batch_invariant=True))
    base = default
    rows.append(
        QualityConfig(
            f"default + speculation k={SPEC_TOKENS}",
            **{**base, "num_speculative_tokens": SPEC_TOKENS},
        )
    )
    rows.append(QualityConfig("default + prefix cache", **{**base, "enable_prefix_caching": True}))
    rows.append(
        QualityConfig(
            f"bfloat16 int4-decode + speculation k={SPEC_TOKENS}",
            dtype="bfloat16",
            quantization="int4-decode",
            num_speculative_tokens=SPEC_TOKENS,
        )
    )
    # the default's own settings appear once, as its row
    return [rows[0]] + [r for r in rows[1:] if r.engine_fields != default]


def _default_fields() -> dict:
    """What EngineConfig() computes with, quantization resolved as the loader does."""
    import torch

    from engine import EngineConfig
    from engine.engine import DTYPES
    from engine.loader import resolve_quantization

    c = EngineConfig()
    quant = resolve_quantization(
        c.quantization, DTYPES[c.dtype], torch.device(c.device), c.batch_invariant
    )
    return {
        "dtype": c.dtype,
        "quantization": quant,
        "batch_invariant": c.batch_invariant,
        "num_speculative_tokens": c.num_speculative_tokens,
        "enable_prefix_caching": c.enable_prefix_caching,
        "quantized_gemv": c.quantized_gemv,
        "fused_decode": c.fused_decode,
        "kv_cache_dtype": c.kv_cache_dtype,
        "amx_prefill": c.amx_prefill,
    }


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "quality", help="KL / top-1 / perplexity vs fp32 and greedy chat agreement, per config"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=".brigade/bench", help="directory for quality.md/.json")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"1,024 corpus tokens, {QUICK_PROMPTS} prompts of 24 tokens",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per chat answer")
    p.add_argument(
        "--only",
        action="append",
        default=None,
        help="a row to run, by the start of its name (repeat it for more): --only default",
    )
    p.add_argument(
        "--llama-cpp-dir",
        default=None,
        help="a llama.cpp build with llama-server, for its greedy answers (default: "
        "$LLAMA_CPP_DIR or the build `brigade bench peer` cached)",
    )
    p.add_argument(
        "--no-llama-cpp", action="store_true", help="skip llama.cpp's answers (and its start-up)"
    )
    p.set_defaults(func=run)


def load_corpus(tokenizer, max_tokens: int | None) -> list[int]:
    ids = tokenizer.encode(CORPUS.read_text())
    return ids[:max_tokens] if max_tokens else ids


def load_prompts(limit: int | None = None) -> list[str]:
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    return prompts[:limit] if limit else prompts


def teacher_forced(
    model, ref, segments, *, spec_tokens: int, kv_dtype=None, prefill_on=None
) -> dict:
    """Every path of one model against the reference: prefill, decode at DECODE_STREAMS rows and
    at WIDE_STREAMS; with `spec_tokens` the decode paths are the verification of accepted drafts
    (streams x (1 + k) rows within 8 and 32); the KV cache in `kv_dtype` (None: the model's).
    `prefill_on`: (reference, segments) of the prefill path, segments of PREFILL_CHUNK tokens
    (None: `ref` and `segments`, as short as the decode paths need them)."""
    from tools.bench.quality_forced import forced_logits, score

    prefill_ref, prefill_segments = prefill_on or (ref, segments)
    prefill = score(
        prefill_ref,
        prefill_segments,
        forced_logits(
            model,
            prefill_segments,
            num_streams=1,
            tokens_per_step=PREFILL_CHUNK,
            kv_dtype=kv_dtype,
        ),
    )
    res = {"prefill": prefill}
    for path, rows in (("decode", DECODE_STREAMS), ("decode_wide", WIDE_STREAMS)):
        streams, per_step = max(1, rows // (1 + spec_tokens)), 1 + spec_tokens
        decode = score(
            ref,
            segments,
            forced_logits(
                model, segments, num_streams=streams, tokens_per_step=per_step, kv_dtype=kv_dtype
            ),
        )
        decode["streams"], decode["tokens_per_step"] = streams, per_step
        res[path] = decode
    return res


def greedy_answers(engine, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"q{i}", ids, params)
        out[f"q{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"q{i}"] for i in range(len(prompt_ids))]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two answers differ; None when they are identical."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def compare_answers(reference: list[list[int]], answers: list[list[int]]) -> dict:
    firsts = [first_divergence(r, a) for r, a in zip(reference, answers, strict=True)]
    diverged = [f for f in firsts if f is not None]
    return {
        "num_prompts": len(firsts),
        "identical": len(firsts) - len(diverged),
        "first_divergence": firsts,
        "median_first_divergence": statistics.median(diverged) if diverged else None,
    }


class FlippedMargins:
    """At a chat's first divergence, the fp32 reference model's own margin between its token and
    the configuration's (the difference of their logits, in nats): how near a tie the flipped
    choice was. Two fp32 paths of this engine that sum in other orders move such a margin by
    ~1e-5 nats, fp16 rounding by ~1e-3; a bf16 slip flips margins of a tenth of a nat and more.
    Cached by (prompt, position): the rows diverge at the same places."""

    def __init__(self, model, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
        self.model, self.prompt_ids, self.reference = model, prompt_ids, reference
        self._logits: dict[tuple[int, int], Tensor] = {}  # [vocab] rows

    def of(self, answers: list[list[int]], firsts: list[int | None]) -> list[float | None]:
        out: list[float | None] = []
        for i, (f, answer) in enumerate(zip(firsts, answers, strict=True)):
            ref = self.reference[i]
            if f is None or f >= min(len(ref), len(answer)):  # identical, or one ends sooner
                out.append(None)
                continue
            if (i, f) not in self._logits:  # the last position's row alone is kept
                self._logits[(i, f)] = self.model.logits(self.prompt_ids[i] + ref[:f])[-1].clone()
            row = self._logits[(i, f)]
            out.append(float(row[ref[f]] - row[answer[f]]))
        return out


def with_margins(chat: dict, margins: list[float | None]) -> dict:
    flipped = [m for m in margins if m is not None]
    return {**chat, "flipped_margins": margins,
            "widest_flipped_margin": max(flipped) if flipped else None}  # fmt: skip


def meets_targets(tf: dict | None) -> bool | None:
    if tf is None:
        return None
    return all(
        tf[p]["top1"] >= TARGET_TOP1 and tf[p]["mean_kl"] <= TARGET_KL for p in PATHS if p in tf
    )


def llama_cpp_answers(
    llama_cpp_dir: Path | None, gguf: Path, prompt_ids: list[list[int]], max_tokens: int
) -> list[list[int]] | str:
    """llama.cpp's greedy answers, as token ids, to the same rendered chat prompts: its
    llama-server (from `llama_cpp_dir`, else the build `brigade bench peer` caches) asked for each
    prompt's token ids with temperature 0 (greedy) and no prompt cache, stopping where the model
    ends its turn or at `max_tokens`. A string: why there is none."""
    import urllib.request

    import torch

    from tools.bench.serve import LlamaServer, llama_server_binary

    binary = llama_server_binary(llama_cpp_dir)
    if isinstance(binary, str):
        return binary
    longest = max(len(ids) for ids in prompt_ids) + max_tokens
    answers = []
    with LlamaServer(binary, gguf, 1, torch.get_num_threads(), longest + 64) as server:
        for ids in prompt_ids:
            body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                    "cache_prompt": False, "return_tokens": True}  # fmt: skip
            request = urllib.request.Request(
                server.url + "/completion",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                answers.append(list(json.loads(response.read())["tokens"]))
    return answers


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import Engine, EngineConfig
    from engine.engine import DTYPES
    from engine.loader import load_model, read_gguf, read_hf_dir
    from engine.tokenizer import load_tokenizer
    from engine.weights import model_format, resolve_model
    from schemas import settings
    from tools.bench.files import write_results
    from tools.bench.quality_forced import Reference, split_segments
    from tools.bench.quality_reference import ReferenceLlama

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    corpus = load_corpus(tokenizer, 1024 if args.quick else None)
    # 32 equal segments: the decode paths run them 8 and 32 streams side by side
    segment_len = -(-len(corpus) // WIDE_STREAMS)
    segments = split_segments(corpus, segment_len, None)
    prefill_segments = split_segments(corpus, PREFILL_CHUNK, None)  # whole prompts' steps
    prompts = load_prompts(QUICK_PROMPTS if args.quick else None)
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    prompt_ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    configs = all_configs()
    if args.only:  # row names hold commas, so each --only is one prefix
        configs = [c for c in configs if any(c.name.startswith(p) for p in args.only)]
        if not configs:
            print(f"no row starts with {' or '.join(map(repr, args.only))}", file=sys.stderr)
            return 2

    path = resolve_model(args.model)
    model_config, weights = read_hf_dir(path) if model_format(path) == "hf" else read_gguf(path)
    print(f"fp32 reference over {len(corpus)} corpus tokens ...", flush=True)
    ref = Reference(segments, model_config.vocab_size)
    ref_model = ReferenceLlama(model_config, weights)
    ref.fill(ref_model, segments)
    prefill_ref = Reference(prefill_segments, model_config.vocab_size)
    prefill_ref.fill(ref_model, prefill_segments)
    del weights
    engine_common = {"model": args.model, "max_num_seqs": CHAT_STREAMS}
    fp32_engine = Engine(
        EngineConfig(**engine_common, dtype="float32", quantization=None, quantized_gemv=False)
    )
    reference_answers = greedy_answers(fp32_engine, prompt_ids, max_tokens)
    del fp32_engine
    margins = FlippedMargins(ref_model, prompt_ids, reference_answers)

    def chat_of(answers: list[list[int]]) -> dict:
        chat = compare_answers(reference_answers, answers)
        return with_margins(chat, margins.of(answers, chat["first_divergence"]))

    res: dict = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "corpus": {
            "file": CORPUS.name,
            "tokens": len(corpus),
            "segments": len(segments),
            "prefill_segments": len(prefill_segments),
        },
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "targets": {"top1": TARGET_TOP1, "mean_kl": TARGET_KL},
        "rows": [],
    }
    for c in configs:
        print(
            f"{c.name}: teacher-forced prefill + decode, {len(prompts)} chat prompts ...",
            flush=True,
        )
        row: dict = {"name": c.name, **c.engine_fields}
        if c.enable_prefix_caching:
            row["teacher_forced"] = None  # the same model and paths as without; chat measures it
        else:
            model, _ = load_model(
                args.model,
                dtype=c.dtype,
                quantization=c.quantization,
                batch_invariant=c.batch_invariant,
                quantized_gemv=c.quantized_gemv,
                fused_decode=c.fused_decode,
                amx_prefill=c.amx_prefill,
            )
            kv = None if c.kv_cache_dtype == "auto" else DTYPES[c.kv_cache_dtype]
            row["teacher_forced"] = teacher_forced(
                model,
                ref,
                segments,
                spec_tokens=c.num_speculative_tokens,
                kv_dtype=kv,
                prefill_on=(prefill_ref, prefill_segments),
            )
            del model
        engine = Engine(EngineConfig(**engine_common, **c.engine_fields))
        answers = greedy_answers(engine, prompt_ids, max_tokens)
        del engine
        row["chat"] = chat_of(answers)
        row["meets_targets"] = meets_targets(row["teacher_forced"])
        res["rows"].append(row)
    ref.close()
    prefill_ref.close()
    res["llama_cpp"] = None
    llama_dir = args.llama_cpp_dir or settings.LLAMA_CPP_DIR.get()
    if model_format(path) == "gguf" and not args.no_llama_cpp:
        print(f"llama.cpp: greedy answers to the {len(prompts)} chat prompts ...", flush=True)
        found = llama_cpp_answers(Path(llama_dir) if llama_dir else None, path, prompt_ids,
                                  max_tokens)  # fmt: skip
        if isinstance(found, str):
            res["llama_cpp_skipped"] = found
        else:
            res["llama_cpp"] = {
                "chat": chat_of(found),
                "answers": [tokenizer.decode(a) for a in found],
            }
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    write_results(args.out, "quality", res, markdown(res))
    return 0


def _margin(chat: dict) -> str:
    m = chat.get("widest_flipped_margin")
    return "—" if m is None else f"{m:.2g}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def markdown(res: dict) -> str:
    tgt = res["targets"]
    lines = [
        f"Quality set: {res['model']}, teacher-forced over {res['corpus']['tokens']} tokens of "
        f"{res['corpus']['file']} ({res['corpus']['segments']} segments for decode, "
        f"{res['corpus'].get('prefill_segments', res['corpus']['segments'])} of "
        f"{PREFILL_CHUNK} tokens for prefill) against the plain fp32 "
        f"reference; {res['prompts']} chat prompts, greedy, {res['max_tokens']} tokens, against "
        f"the fp32 engine. Targets: top-1 >= {100 * tgt['top1']:.0f} % and mean KL <= "
        f"{tgt['mean_kl']} on every path. {res['threads']} threads; {res['wall_s']} s",
        "",
        "| configuration | prefill KL | prefill top-1 | prefill ppl | decode KL | decode top-1 | "
        "decode ppl | 32-stream decode KL | 32-stream decode top-1 | chat identical | "
        "median first divergence | widest margin flipped (nats) | meets targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        tf, chat = r["teacher_forced"], r["chat"]
        if tf is None:
            cells = ["as without the prefix cache"] + [""] * 7
        else:
            p, d = tf["prefill"], tf["decode"]
            w = tf.get("decode_wide")
            cells = [
                f"{p['mean_kl']:.5f}",
                _pct(p["top1"]),
                f"{p['ppl']:.3f}",
                f"{d['mean_kl']:.5f}",
                _pct(d["top1"]),
                f"{d['ppl']:.3f}",
                f"{w['mean_kl']:.5f}" if w else "—",
                _pct(w["top1"]) if w else "—",
            ]
        med = chat["median_first_divergence"]
        met = {True: "yes", False: "no", None: "—"}[r["meets_targets"]]
        lines.append(
            f"| {r['name']} | "
            + " | ".join(cells)
            + f" | {chat['identical']}/{chat['num_prompts']} | {'—' if med is None else med} | "
            f"{_margin(chat)} | {met} |"
        )
    forced = next((r["teacher_forced"] for r in res["rows"] if r["teacher_forced"]), None)
    if forced:  # each path's segments are its own contexts, so each has its perplexity
        lines += [
            "",
            f"fp32 reference perplexity: prefill {forced['prefill']['ref_ppl']:.3f} "
            f"({PREFILL_CHUNK}-token segments), decode {forced['decode']['ref_ppl']:.3f} "
            f"({res['corpus']['segments']} segments)",
        ]
    lc = res.get("llama_cpp")
    if lc is None:
        why = res.get("llama_cpp_skipped") or "not asked (--no-llama-cpp) or not a GGUF model"
        lines.append(f"llama.cpp: skipped: {why}")
    else:
        chat, med = lc["chat"], lc["chat"]["median_first_divergence"]
        lines.append(
            f"llama.cpp's greedy answers (llama-server, the same GGUF and prompt tokens) "
            f"identical to the fp32 reference's: {chat['identical']}/{chat['num_prompts']}; "
            f"median first divergence {'—' if med is None else med}; widest margin flipped "
            f"{_margin(chat)} nats"
        )
    lines.append("")
    return "\n".join(lines)
