"""Speculative decoding: the n-gram proposer's drafts (exact tokens), and lossless verification:
the same greedy tokens and logprobs as plain decoding, in fewer steps, stops honoured."""

import dataclasses

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.spec_decode import propose_ngram
from tests.engine.test_engine import TEXTS
from tests.engine.tiny_llama import write_tiny_llama


def test_proposes_what_followed_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    two = {"min_n": 2}
    assert propose_ngram([9, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 2, **two) == [6, 7]  # the latest
    # the 3-gram (8, 1, 2) beats the more recent 2-gram (1, 2)
    assert propose_ngram([8, 1, 2, 4, 4, 1, 2, 6, 8, 1, 2], 2, **two) == [4, 4]
    # by default a match needs 3 tokens: 2-gram matches are mostly chance in open text
    assert propose_ngram([9, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 2) == []
    assert propose_ngram([1, 2, 3, 4, 5], 3) == []  # no earlier occurrence
    assert propose_ngram([5, 6, 7, 5, 6, 7], 0) == [] and propose_ngram([5, 6, 7], 3) == []
    assert propose_ngram([3, 4, 5, 9, 3, 4, 5], 8) == [9, 3, 4, 5]  # as many as there are


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def run(engine, prompts, params):
    """-> per request (token ids, logprobs, tokens in each of its step outputs)."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out = {f"r{i}": ([], [], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            ids, logprobs, sizes = out[o.request_id]
            ids += o.new_token_ids
            logprobs += o.new_logprobs or []
            sizes.append(len(o.new_token_ids))
    return [out[f"r{i}"] for i in range(len(prompts))]


def tiny_engine(model, k):
    return Engine(
        EngineConfig(model=str(model), dtype="float32", block_size=4, num_speculative_tokens=k)
    )


# the tiny random model falls into a loop after this prompt, which the proposer follows
LOOPING = [40, 41] * 3


def test_greedy_output_is_unchanged_with_fewer_step_outputs(tiny_dir):
    prompts = [LOOPING, [5, 6, 7, 8] * 6, [13, 14] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    plain = run(tiny_engine(tiny_dir, 0), prompts, params)
    spec_engine = tiny_engine(tiny_dir, 4)
    spec = run(spec_engine, prompts, params)
    assert [ids for ids, _, _ in spec] == [ids for ids, _, _ in plain]
    for (_, lp_spec, _), (_, lp_plain, _) in zip(spec, plain, strict=True):  # fp32: to ~ulps
        assert [x[0][0] for x in lp_spec] == [x[0][0] for x in lp_plain]
        assert [x[0][1] for x in lp_spec] == pytest.approx([x[0][1] for x in lp_plain], abs=1e-4)
    stats = spec_engine.stats()
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens
    # each accepted draft token is one more token in that step's output, one step fewer
    extra = [sum(n - 1 for n in sizes) for _, _, sizes in spec]
    assert sum(extra) == stats.num_accepted_draft_tokens and extra[0] > 0
    assert [len(sizes) for _, _, sizes in spec] == [40 - e for e in extra]
    assert all(sizes == [1] * 40 for _, _, sizes in plain)


def test_max_tokens_and_stop_ids_hold_where_drafts_are_accepted(tiny_dir):
    """(The verification of a stop inside a draft, token by token: test_scheduler.py.)"""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ((ids, _, sizes),) = run(tiny_engine(tiny_dir, 4), [LOOPING], greedy)
    at = sum(sizes[: next(i for i, n in enumerate(sizes) if n > 1)])  # first multi-token output
    for params in (
        dataclasses.replace(greedy, max_tokens=at + 2),  # a draft of one token fits, no more
        dataclasses.replace(greedy, stop_token_ids=(ids[at + 1],)),
    ):
        engine = tiny_engine(tiny_dir, 4)
        ((got, _, _),) = run(engine, [LOOPING], params)
        assert got == ids[: ids.index(ids[at + 1]) + 1 if params.stop_token_ids else at + 2]
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_smollm2_bf16_batch_invariant_speculation_changes_no_bit():
    """In the batch-invariant mode a verified draft gives exactly the tokens and logprobs of
    plain decoding, for requests decoded side by side (one repeats itself: drafts are accepted)."""
    texts = ["Say it three times: I like green tea. I like green tea.", TEXTS[0], TEXTS[4]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)

    def engine(k):
        return Engine(
            EngineConfig(dtype="bfloat16", batch_invariant=True, num_speculative_tokens=k)
        )

    plain_engine = engine(0)
    prompts = [plain_engine.tokenizer.encode(t) for t in texts]
    plain = run(plain_engine, prompts, params)
    spec_engine = engine(4)
    spec = run(spec_engine, prompts, params)
    assert [(ids, lps) for ids, lps, _ in spec] == [(ids, lps) for ids, lps, _ in plain]
    assert spec_engine.stats().num_accepted_draft_tokens > 0
    assert max(n for _, _, sizes in spec for n in sizes) > 1


def test_bad_speculation_settings_are_refused():
    with pytest.raises(ValueError, match="EngineConfig.num_speculative_tokens=-1; allowed: >= 0"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="EngineConfig.speculative_max_rows=0; allowed: >= 1"):
        EngineConfig(speculative_max_rows=0)


def test_sampled_requests_speculate_and_a_seed_still_fixes_the_run(tiny_dir):
    """Sampled rows verify their drafts by speculative sampling (its distribution is checked in
    test_sampler.py): drafts are accepted, and the same seed gives the same tokens again. (The
    random stream is consumed differently than without speculation, so a seed's tokens with and
    without it need not match.)"""
    params = SamplingParams(temperature=0.3, seed=5, max_tokens=40, ignore_eos=True)
    engine = tiny_engine(tiny_dir, 4)
    ((first, _, sizes),) = run(engine, [LOOPING], params)
    ((again, _, _),) = run(engine, [LOOPING], params)
    assert first == again and len(first) == 40
    assert engine.stats().num_accepted_draft_tokens > 0 and max(sizes) > 1
