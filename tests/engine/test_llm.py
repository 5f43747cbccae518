"""LLM.generate / LLM.chat: vLLM-shaped offline API, on a tiny Llama and on SmolLM2 (fp32)."""

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny_llama import write_tiny_llama

REFERENCE = Path(__file__).parents[1] / "data" / "hf_greedy_reference.json"


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=64)


def test_generate_strings_and_token_ids_in_prompt_order(tiny_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    long_first = " ".join(f"w{i}" for i in range(40))
    outs = tiny_llm.generate([long_first, [6, 7, 8]], greedy)
    assert [o.prompt_token_ids for o in outs] == [list(range(6, 46)), [6, 7, 8]]
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].text == tiny_llm.tokenizer.decode(outs[0].token_ids)
    alone = tiny_llm.generate([6, 7, 8], greedy)
    assert len(alone) == 1 and alone[0].token_ids == outs[1].token_ids
    assert tiny_llm.generate("w0 w1 w2", greedy)[0].token_ids == outs[1].token_ids


def test_per_prompt_params_seed_and_logprobs(tiny_llm):
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=99, max_tokens=4, ignore_eos=True, logprobs=2),
    ]
    greedy, sampled = tiny_llm.generate([[6, 7], [8, 9]], params)
    assert len(greedy.token_ids) == 3 and greedy.logprobs is None
    assert sampled.seed == 99 and len(sampled.token_ids) == 4
    assert [lp[0][0] for lp in sampled.logprobs] == sampled.token_ids
    assert all(len(lp) == 3 for lp in sampled.logprobs)
    assert tiny_llm.generate([[8, 9]], params[1])[0].token_ids == sampled.token_ids


def test_chat_applies_the_template(tiny_llm):
    conv = [{"role": "user", "content": "w5 w6"}]
    (out,) = tiny_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    # <|im_start|> user w5 w6 <|im_end|> <|im_start|> assistant
    assert out.prompt_token_ids == [1, 3, 11, 12, 2, 1, 4]
    two = tiny_llm.chat([conv, conv], SamplingParams(temperature=0.0, max_tokens=2))
    assert [o.token_ids for o in two] == [out.token_ids, out.token_ids]


def test_bad_requests_raise_and_leave_nothing_behind(tiny_llm):
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        tiny_llm.generate([[6]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="max_model_len 512"):
        tiny_llm.generate([[6, 7], [6] * 500], SamplingParams(max_tokens=16))
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_smollm2_chat_greedy_fp32_matches_transformers_exactly():
    """The first 16 of the reference's 32 greedy tokens (greedy: a shorter run is a prefix of
    the longer one); the first conversation's reply ends with eos before that."""
    ref = json.loads(REFERENCE.read_text())
    llm = LLM(model=ref["model"], dtype=ref["dtype"])
    max_tokens = 16
    outs = llm.chat(
        [c["messages"] for c in ref["conversations"]],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    assert ref["conversations"][0]["greedy_ids"][-1] == ref["eos_token_id"]
    for out, conv in zip(outs, ref["conversations"], strict=True):
        want = conv["greedy_ids"][:max_tokens]
        assert out.prompt_token_ids == conv["prompt_ids"]
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if want[-1] == ref["eos_token_id"] else "length")
