"""Speculative decoding: the n-gram proposer's drafts (exact tokens), which decodes get one, the
greedy verification (exact tokens), speculative sampling against the request's distribution, and
through the engine: the same greedy tokens and logprobs as plain decoding, in fewer steps."""

import dataclasses

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.sampler import SamplingRequest, filtered_probs
from engine.sequence import Sequence
from engine.spec_decode import (
    propose_drafts,
    propose_ngram,
    sample_and_verify,
    verify_greedy,
    verify_sampled,
)
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


REPEATS = [7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 7, 8, 9]  # propose_ngram: [3, 4, 5, 7, 8, 9, ...]


def decoding(rid, arrival=0, **params):
    """A running decode of REPEATS: its last token (9) is its first output, not yet computed."""
    params.setdefault("max_tokens", 100)
    seq = Sequence(rid, REPEATS[:-1], SamplingParams(**params), seed=0, arrival=arrival)
    seq.token_ids.append(REPEATS[-1])
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_proposed_drafts_fit_the_row_budget_max_tokens_and_max_model_len():
    a = decoding("a", 0)
    b = decoding("b", 1, max_tokens=3)  # 1 output: room for 1 draft token, then its own
    c = decoding("c", 2)
    prefilling = decoding("p", 3)
    prefilling.num_computed_tokens = 4
    drafts = propose_drafts(
        [c, prefilling, b, a], num_speculative_tokens=3, max_rows=8, max_model_len=100
    )
    # 3 decode rows; a (first in order) takes 3 more, b 1 (max_tokens), c the last 1 of 8
    assert drafts == {"a": [3, 4, 5], "b": [3], "c": [3]}
    cut = propose_drafts([a], num_speculative_tokens=3, max_rows=8, max_model_len=16)
    assert cut == {"a": [3]}  # 14 tokens: one draft token, then the model's, fill 16
    assert propose_drafts([a], num_speculative_tokens=0, max_rows=8, max_model_len=100) == {}


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"min_tokens": 2},  # still masking eos: its logits depend on more than the position
    ],
)
def test_no_draft_where_a_token_depends_on_more_than_its_rows_logits(params):
    seq = decoding("a", **params)
    assert propose_drafts([seq], num_speculative_tokens=3, max_rows=8, max_model_len=100) == {}


def test_a_constrained_decode_gets_no_draft_and_leaves_the_rows_to_others():
    constrained, other = decoding("g", 0), decoding("o", 1)
    constrained.grammar = object()  # any matcher: its mask would be needed at every draft row
    drafts = propose_drafts(
        [constrained, other], num_speculative_tokens=3, max_rows=5, max_model_len=100
    )
    assert drafts == {"o": [3, 4, 5]}  # 2 decode rows + 3: the whole budget


def test_greedy_verification_keeps_the_agreed_run_then_the_models_token():
    assert verify_greedy((60, 61, 62), [60, 61, 70, 99]) == [60, 61, 70]
    assert verify_greedy((60, 61, 62), [60, 61, 62, 99]) == [60, 61, 62, 99]  # all stood
    assert verify_greedy((60, 61, 62), [50, 61, 62, 99]) == [50]  # the first already differs
    assert verify_greedy((), [42]) == [42]


def sampling_request(seed, **params):
    p = SamplingParams(**params)
    gen = None if p.greedy else torch.Generator().manual_seed(seed)
    return SamplingRequest(p, [], [], gen, ())


def test_speculative_sampling_draws_each_token_from_the_requests_own_distribution():
    """A one-token draft d at row 0: it stands with probability p0(d), else a draw from p0
    without d; either way the first token is distributed as p0 (top-p applied: tokens it cut
    never appear). When it stands, the next token is a draw from row 1. Tolerances are ~4
    standard deviations of a frequency over these draws."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 3.0, 1.0, 0.0, 0.0, 0.0]])
    r = sampling_request(seed=11, temperature=0.9, top_p=0.95)
    p = filtered_probs(logits, r.params)  # [2, 6]
    assert p[0, 4] == p[0, 5] == 0 and float(p[0].sum()) == pytest.approx(1.0)  # top-p cut
    n, draft = 4000, 1
    first, second = torch.zeros(6), torch.zeros(6)
    accepted = 0
    for _ in range(n):
        out = verify_sampled(logits, (draft,), r)
        first[out[0]] += 1
        if len(out) == 2:  # the draft stood: a second token from row 1
            assert out[0] == draft
            accepted += 1
            second[out[1]] += 1
    assert first[4] == first[5] == second[5] == 0  # outside the filtered distributions
    assert accepted / n == pytest.approx(float(p[0, draft]), abs=0.025)
    torch.testing.assert_close(first / n, p[0], atol=0.03, rtol=0)
    torch.testing.assert_close(second / accepted, p[1], atol=0.05, rtol=0)


def test_a_mixed_step_verifies_each_request_its_own_way():
    """Rows in order: a greedy draft (2 rows + 1), a plain sampled row, a sampled draft, a plain
    greedy row; each request gets its verified run, logprobs aligned with its tokens."""
    torch.manual_seed(0)
    logits = torch.randn(7, 11)
    top = logits.argmax(-1).tolist()
    greedy = sampling_request(0, temperature=0.0, logprobs=0)
    drafts = [(top[0], (top[1] + 1) % 11), (), (3,), ()]
    requests = [greedy, sampling_request(1, temperature=0.7), sampling_request(2), greedy]
    tokens, logprobs = sample_and_verify(logits, drafts, requests)
    assert tokens[0] == [top[0], top[1]]  # the second draft token was not the argmax
    assert len(tokens[1]) == 1
    expected = verify_sampled(logits[4:6], (3,), sampling_request(2))  # the same generator seed
    assert tokens[2] == expected and tokens[3] == [top[6]]
    assert [len(lp) for lp in logprobs] == [len(t) for t in tokens]
    assert [lp[0][0] for lp in logprobs[0]] == tokens[0] and logprobs[1] == [None]
    assert logprobs[0][1][0][1] == pytest.approx(float(logits[1].log_softmax(-1)[top[1]]))
    # a batch of greedy drafts alone takes the one plain sampling pass: the same runs
    alone, _ = sample_and_verify(logits[:3], drafts[:1], requests[:1])
    assert alone == tokens[:1]


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
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = tiny_engine(tiny_dir, 4)  # one engine: each run starts and ends with it empty
    ((ids, _, sizes),) = run(engine, [LOOPING], greedy)
    at = sum(sizes[: next(i for i, n in enumerate(sizes) if n > 1)])  # first multi-token output
    for params in (
        dataclasses.replace(greedy, max_tokens=at + 2),  # a draft of one token fits, no more
        dataclasses.replace(greedy, stop_token_ids=(ids[at + 1],)),
    ):
        ((got, _, _),) = run(engine, [LOOPING], params)
        assert got == ids[: ids.index(ids[at + 1]) + 1 if params.stop_token_ids else at + 2]
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_smollm2_bf16_batch_invariant_speculation_changes_no_bit():
    """In the batch-invariant mode a verified draft gives exactly the tokens and logprobs of
    plain decoding, for requests decoded side by side (one repeats itself: drafts are accepted)."""
    texts = ["Say it three times: I like green tea. I like green tea.", TEXTS[0], TEXTS[4]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)

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
