"""`brigade bench prefix`: a wave reports each request's first-token time and its tokens; the
table compares the cache off and on, with the gain the right way round."""

from engine import Engine, EngineConfig, SamplingParams
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench.prefix import markdown, run_wave


def test_a_wave_times_every_request_and_the_second_wave_hits_the_cache(tmp_path):
    model = write_tiny_llama(tmp_path / "llama")
    engine = Engine(
        EngineConfig(model=str(model), dtype="float32", block_size=4, enable_prefix_caching=True)
    )
    system = list(range(3, 23))  # 20 tokens: 5 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    firsts, tokens = run_wave(engine, [("a", system + [30]), ("b", system + [31, 32])], params)
    assert len(firsts) == 2 and all(t > 0 for t in firsts) and tokens == 6
    assert engine.stats().num_prefix_hits == 0  # side by side: neither was computed before
    run_wave(engine, [("c", system + [33])], params)
    assert engine.stats().num_prefix_hits == 20


def test_table_puts_off_and_on_side_by_side():
    def mode(scale: float, hits: float) -> dict:
        return {
            "ttft_mean_ms": 800 * scale,
            "ttft_p95_ms": 1000 * scale,
            "wall_s": 10 * scale,
            "tok_per_s": 50 / scale,
            "prefix_hit_rate": hits,
        }

    workload = {
        "system_tokens": 1024,
        "question_tokens": 32,
        "max_tokens": 32,
        "concurrency": 8,
        "waves": 3,
    }
    res = {
        "model": "m",
        "dtype": "bfloat16",
        "threads": 2,
        "load_average_at_start": [0.5],
        "workload": workload,
        "modes": {"off": mode(1.0, 0.0), "on": mode(0.25, 0.9)},
    }
    table = markdown(res)
    assert "| time to first token, mean (ms) | 800.0 | 200.0 | 4.00x |" in table
    assert "| aggregate tok/s | 50.0 | 200.0 | 4.00x |" in table
    assert "| prompt tokens found in the cache | 0.0% | 90.0% | |" in table
