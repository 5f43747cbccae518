"""`brigade bench invariant`: its check counts requests that agree alone and batched, and its
table puts the two modes side by side with their ratio."""

from engine import Engine, EngineConfig
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench.invariant import CHECK_TEXTS, markdown, same_alone_as_batched


def test_the_invariant_engine_agrees_on_every_check_request(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    small = {"num_kv_blocks": 24, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    engine = Engine(
        EngineConfig(
            model=str(model), dtype="bfloat16", block_size=4, batch_invariant=True, **small
        )
    )
    n = len(CHECK_TEXTS)
    assert same_alone_as_batched(engine, max_tokens=12) == {"tokens": n, "logprobs": n}
    assert engine.stats().num_preemptions > 0


def test_table_has_both_modes_and_the_ratio():
    def mode(scale: float, same: int) -> dict:
        streams = {"decode_only_tok_per_s": 200 * scale, "tok_per_s": 120 * scale}
        return {
            "prefill_tok_per_s": {128: 1000 * scale, 2048: 700 * scale},
            "single_decode_tok_per_s": 80 * scale,
            "streams_8": streams,
            "streams_32": {k: v * 2 for k, v in streams.items()},
            "same_alone_as_batched": {"tokens": same, "logprobs": same - 1},
        }

    res = {
        "model": "m",
        "threads": 2,
        "dtype": "float32",
        "streams": [8, 32],
        "load_average_at_start": [0.5],
        "wall_s": 1.0,
        "modes": {"default": mode(1.0, 5), "batch_invariant": mode(0.5, 8)},
    }
    table = markdown(res)
    assert "| prefill 2048 tokens, tok/s | 700.0 | 350.0 | 0.50x |" in table
    assert "| 8 streams, decode steps, tok/s | 200.0 | 100.0 | 0.50x |" in table
    assert "| 32 streams, wall incl. prefill, tok/s | 240.0 | 120.0 | 0.50x |" in table
    assert "| greedy requests the same alone as batched (of 8): tokens | 5 | 8 | |" in table
    assert "| ... and every logprob, bit for bit | 4 | 7 | |" in table
