"""`brigade bench spec`: one stream's decode speed after its first token, and the table."""

from engine import Engine, EngineConfig, SamplingParams
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench.spec import decode, markdown


def test_decode_returns_every_token_and_a_speed(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    engine = Engine(
        EngineConfig(model=str(model), dtype="float32", block_size=4, num_speculative_tokens=4)
    )
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens, speed = decode(engine, [40, 41] * 3, params, "r")
    assert len(tokens) == 20 and speed > 0


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
