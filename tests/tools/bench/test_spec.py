"""`brigade bench spec`: one stream's decode speed after its first token, and the table."""

import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench.spec import decode, draft_agreement, markdown, speedup_bound


def test_decode_returns_every_token_and_a_speed(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    engine = Engine(
        EngineConfig(model=str(model), dtype="float32", block_size=4, num_speculative_tokens=4)
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens, speed = decode(engine, [40, 41] * 3, params, "r")
    assert len(tokens) == 20 and speed > 0


TABLE = {
    "model": "m",
    "dtype": "float32",
    "threads": 2,
    "num_speculative_tokens": 4,
    "max_tokens": 96,
    "load_average_at_start": [0.5],
    "prompts": {},
}


def test_table_rows_per_prompt():
    res = {
        "model": "m",
        "dtype": "bfloat16",
        "threads": 2,
        "num_speculative_tokens": 4,
        "max_tokens": 96,
        "load_average_at_start": [0.5],
        "prompts": {
            "copy": {
                "prompt_tokens": 97,
                "off_tok_per_s": 90.0,
                "on_tok_per_s": 126.0,
                "speedup": 1.4,
                "acceptance": 0.77,
                "same_tokens": True,
            },
            "open": {
                "prompt_tokens": 46,
                "off_tok_per_s": 92.0,
                "on_tok_per_s": 90.0,
                "speedup": 0.98,
                "acceptance": None,
                "same_tokens": True,
            },
        },
    }
    table = markdown(res)
    assert "| copy (97 tokens) | 90.0 | 126.0 | 1.40x | 77% | yes |" in table
    assert "| open (46 tokens) | 92.0 | 90.0 | 0.98x | — | yes |" in table


def test_the_speedup_bound_counts_accepted_drafts_against_their_cost():
    assert speedup_bound(0.0, 0.5) == (pytest.approx(1 / 1.5), 1)  # nothing stands: k = 1
    assert speedup_bound(1.0, 0.0, max_k=4) == (pytest.approx(5.0), 4)  # free and always right
    bound, k = speedup_bound(0.557, 26 / 30)  # the measured all-but-4-middle-layers draft
    assert bound == pytest.approx(1.557 / (1 + 26 / 30)) and k == 1 and bound < 1
    assert speedup_bound(0.8, 0.1)[0] > 2  # a cheap, good draft pays


def test_draft_agreement_of_the_models_own_layers(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    engine = Engine(EngineConfig(model=str(model), dtype="float32", block_size=4))
    ids = [(7 * i) % 250 + 3 for i in range(40)]
    rows = draft_agreement(engine, ids, exits=(1, 2, 8), skips={"1": [1], "0": [0], "9": [9]})
    # the 2-layer model: the first layer alone twice (as an exit and as all but layer 1), all but
    # layer 0; exits of 2 or more layers and skips past the model are no drafts
    assert [(r["draft"], r["layers"]) for r in rows] == [
        ("first 1 layers", 1), ("all but 1", 1), ("all but 0", 1)
    ]  # fmt: skip
    assert rows[0]["agreement"] == rows[1]["agreement"]
    assert all(0.0 <= r["agreement"] <= 1.0 for r in rows)
    assert all(r["speedup_bound"] == round(speedup_bound(r["agreement"], 0.5)[0], 2) for r in rows)
    table = markdown({**TABLE, "self_drafts": rows, "self_draft_tokens": 40})
    assert "| first 1 layers | 1 |" in table and "over 40 corpus tokens" in table
