"""The quality gate: a slice of `brigade bench quality` (512 corpus tokens, both paths) on which
the default configuration must keep the targets against the plain fp32 reference: teacher-forced
top-1 >= 99 % and mean KL <= 0.001, on the prefill path (segments of 128 tokens, each one step of
128 rows: the prefill GEMMs, AMX's where it runs) and on the decode path at 8 and at 32 streams
(the fused forward's most rows: at AVX-512 the rows as vector lanes)."""

import pytest

from engine.engine import DTYPES
from engine.loader import load_model, read_gguf
from engine.tokenizer import load_tokenizer
from engine.weights import resolve_model
from tools.bench.quality import (
    TARGET_KL,
    TARGET_TOP1,
    WIDE_STREAMS,
    _default_fields,
    load_corpus,
    teacher_forced,
)
from tools.bench.quality_forced import Reference, split_segments
from tools.bench.quality_reference import ReferenceLlama

MODEL = "smollm2-135m"
NUM_TOKENS = 512
PREFILL_SEGMENT = 128  # past the GEMV's 32 rows: a step of the prefill GEMMs


@pytest.fixture(scope="module")
def default_scores():
    corpus = load_corpus(load_tokenizer(MODEL), NUM_TOKENS)
    segments = split_segments(corpus, NUM_TOKENS // WIDE_STREAMS, None)
    long_segments = split_segments(corpus, PREFILL_SEGMENT, None)
    config, weights = read_gguf(resolve_model(MODEL))
    ref, long_ref = (
        Reference(segments, config.vocab_size),
        Reference(long_segments, config.vocab_size),
    )
    reference = ReferenceLlama(config, weights)
    ref.fill(reference, segments)
    long_ref.fill(reference, long_segments)
    del weights, reference
    d = _default_fields()
    model, _ = load_model(
        MODEL,
        dtype=d["dtype"],
        quantization=d["quantization"],
        batch_invariant=d["batch_invariant"],
        quantized_gemv=d["quantized_gemv"],
        fused_decode=d["fused_decode"],
        amx_prefill=d["amx_prefill"],
    )
    kv = None if d["kv_cache_dtype"] == "auto" else DTYPES[d["kv_cache_dtype"]]
    try:
        yield teacher_forced(
            model,
            ref,
            segments,
            spec_tokens=d["num_speculative_tokens"],
            kv_dtype=kv,
            prefill_on=(long_ref, long_segments),
        )
    finally:
        ref.close()
        long_ref.close()


@pytest.mark.parametrize("path", ["prefill", "decode", "decode_wide"])
def test_default_configuration_keeps_the_quality_targets(default_scores, path):
    s = default_scores[path]
    segments = NUM_TOKENS // PREFILL_SEGMENT if path == "prefill" else WIDE_STREAMS
    assert s["num_positions"] == NUM_TOKENS - segments
    assert s["top1"] >= TARGET_TOP1, (
        f"{path}: top-1 {100 * s['top1']:.2f} % < {100 * TARGET_TOP1:.0f} % against fp32; "
        f"first flips (segment, position): {s['first_flips'][:5]}"
    )
    assert s["mean_kl"] <= TARGET_KL, f"{path}: mean KL {s['mean_kl']:.5f} > {TARGET_KL}"
