import math

import pytest
import torch

from engine.params import SamplingParams
from engine.sampler import (
    SamplingRequest,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    sample,
    takes_the_argmax,
)

NEG = float("-inf")


def req(prompt=(0,), output=(), seed=0, stop_while_short=(), **params):
    p = SamplingParams(**params)
    gen = None if p.greedy else torch.Generator().manual_seed(seed)
    return SamplingRequest(p, list(prompt), list(output), gen, tuple(stop_while_short))


def test_top_k_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k(logits, torch.tensor([2, 1]))
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG], [4.0, NEG, NEG, NEG]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_top_p(probs.log(), torch.tensor([0.75, 0.9]))
    assert torch.isinf(out).tolist() == [[False, False, True, True], [False, False, False, True]]
    assert out[0, :2].tolist() == pytest.approx(probs[0, :2].log().tolist())


def test_min_p_relative_to_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.4]))  # threshold 0.2
    assert torch.isinf(out).tolist() == [[False, False, True, True]]


def test_penalties_on_fixed_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    r = req(prompt=(0,), output=(1, 2, 2), repetition_penalty=2.0, temperature=0.0)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 0.5, 0.5, 3.0]]
    r = req(prompt=(0,), output=(1, 2, 2), presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [r])
    # prompt token 0 untouched; 1 seen once: -0.5 - 0.25; 2 seen twice: -0.5 - 0.5
    assert out.tolist() == [[2.0, -2.75, 0.0, 0.5, 3.0]]


def test_greedy_is_argmax_without_division_and_masks_stop_while_short():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    ids, lps = sample(logits, [req(temperature=0.0), req(temperature=0.0, stop_while_short=(0,))])
    assert ids == [1, 1] and lps is None


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    assert sample(logits, [req(temperature=0.0, output=(0,))])[0] == [0]
    assert sample(logits, [req(temperature=0.0, output=(0,), repetition_penalty=2.0)])[0] == [1]


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    a = [sample(logits[:1], [req(seed=42)])[0][0] for _ in range(1)]
    draws_alone, draws_batched = [], []
    gen_alone = req(seed=42)
    batch = [req(seed=42), req(seed=7), req(temperature=0.0)]
    for _ in range(20):
        draws_alone.append(sample(logits[:1], [gen_alone])[0][0])
        draws_batched.append(sample(logits, batch)[0][0])
    assert draws_alone == draws_batched and draws_alone[0] == a[0]
    assert len(set(draws_alone)) > 3  # it is really random, not argmax


def test_top_k_one_equals_greedy_at_any_temperature():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    ids, _ = sample(logits, [req(seed=s, temperature=1.5, top_k=1) for s in range(4)])
    assert ids == logits.argmax(-1).tolist()


def test_distribution_matches_softmax_on_small_vocab():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    r = req(seed=123, temperature=0.7)
    n = 4000
    counts = [0, 0, 0, 0]
    for _ in range(n):
        counts[sample(logits, [r])[0][0]] += 1
    expected = (logits[0] / 0.7).softmax(-1).tolist()
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected, strict=True))
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_filtered_tokens_are_never_drawn():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6]])
    r = req(seed=3, top_k=3, top_p=0.5)
    drawn = {sample(logits, [r])[0][0] for _ in range(200)}
    assert drawn == {0, 1}


def test_logprobs_sampled_first_then_top_n_from_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    ids, lps = sample(
        logits, [req(temperature=0.0, logprobs=2, output=(0,), repetition_penalty=5.0)]
    )
    raw = logits.log_softmax(-1)[0].tolist()
    assert ids == [1]
    assert [t for t, _ in lps[0]] == [1, 0, 1]
    assert [v for _, v in lps[0]] == pytest.approx([raw[1], raw[0], raw[1]])
    assert math.isclose(sum(math.exp(v) for v in raw), 1.0, rel_tol=1e-6)


def test_top_p_widens_its_candidates_until_exact():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]])
    out = apply_top_p(probs.log(), torch.tensor([0.85, 0.5]))  # row 0 needs 3 tokens
    assert torch.isinf(out).tolist() == [[False, False, False, True], [False, True, True, True]]


def test_top_p_bucketed_candidates_match_a_full_sort():
    gen = torch.Generator().manual_seed(0)
    # peaked, flat and mixed rows over a 5000-token vocabulary
    scale = torch.tensor([8.0, 0.1, 2.0, 4.0, 1.0, 0.5])[:, None]
    logits = torch.randn(6, 5000, generator=gen) * scale
    p = torch.tensor([0.95, 0.9, 0.5, 0.99, 0.01, 0.7])
    probs, ids = logits.softmax(-1).sort(
        dim=-1, descending=True, stable=True
    )  # ties: lower id first
    keep_sorted = (probs.double().cumsum(-1) - probs.double()) < p.double()[:, None]
    expected = torch.zeros_like(keep_sorted).scatter_(1, ids, keep_sorted)
    out = apply_top_p(logits, p)
    assert torch.equal(~torch.isinf(out), expected)
    assert expected.sum(1).tolist() == [int(k) for k in (~torch.isinf(out)).sum(1)]
    assert expected[0].sum() < 50 < 1000 < expected[1].sum()  # peaked vs flat rows


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_top_p_matches_a_full_sort_with_bf16_ties(seed):
    """bf16 logits tie often; ties rank the lower id first, in and around the boundary bucket."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([6.0, 0.2, 1.5, 3.0, 0.05, 1.0, 10.0, 0.7])[:, None]
    logits = (torch.randn(8, 20000, generator=gen) * scale).bfloat16().float()
    p = torch.rand(8, generator=gen) * 0.98 + 0.01
    probs, ids = logits.softmax(-1).sort(dim=-1, descending=True, stable=True)
    keep_sorted = (probs.double().cumsum(-1) - probs.double()) < p.double()[:, None]
    expected = torch.zeros_like(keep_sorted).scatter_(1, ids, keep_sorted)
    assert torch.equal(~torch.isinf(apply_top_p(logits, p)), expected)


def test_top_p_of_a_row_does_not_depend_on_the_rows_beside_it():
    """Each row's boundary mass is summed on its own: flat rows with many boundary tokens before
    it leave a peaked row's kept set, and its logits, bit for bit as when it is alone."""
    gen = torch.Generator().manual_seed(4)
    scale = torch.tensor([0.05, 0.1, 0.2, 8.0, 0.05, 1.0])[:, None]
    logits = (torch.randn(6, 30000, generator=gen) * scale).bfloat16().float()
    p = torch.tensor([0.99, 0.95, 0.9, 0.9, 0.5, 0.8])
    together = apply_top_p(logits, p)
    for i in range(6):
        assert torch.equal(apply_top_p(logits[i : i + 1], p[i : i + 1]), together[i : i + 1])


def test_logit_bias_forces_and_bans_tokens_per_row():
    """+100 makes a token the greedy choice and the sampled one; -100 bans the row's argmax; a
    row without a bias (beside them in the batch) keeps every bit."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    top = int(logits[1].argmax())
    forced = req(temperature=0.0, logit_bias={7: 100.0})
    banned = req(temperature=1.0, seed=1, logit_bias={top: -100})
    plain = req(temperature=0.0)
    out = apply_logit_bias(logits, [forced, banned, plain])
    assert out[0, 7] == logits[0, 7] + 100 and out[1, top] == logits[1, top] - 100
    assert torch.equal(out[2], logits[2]) and torch.equal(out[0, :7], logits[0, :7])
    ids, _ = sample(logits, [forced, banned, plain])
    assert ids[0] == 7 and ids[1] != top and ids[2] == int(logits[2].argmax())
    drawn = [
        sample(logits[:1].clone(), [req(temperature=1.0, seed=s, logit_bias={7: 100})])[0][0]
        for s in range(50)
    ]  # fmt: skip
    assert drawn == [7] * 50
    free = [sample(logits[1:2].clone(), [req(temperature=2.0, seed=s)])[0][0] for s in range(300)]
    assert top in free  # without the bias the argmax is drawn ...
    never = [
        sample(logits[1:2].clone(), [req(temperature=2.0, seed=s, logit_bias={top: -100})])[0][0]
        for s in range(300)
    ]  # fmt: skip
    assert top not in never  # ... with -100 never


def test_takes_the_argmax_exactly_when_sample_gives_the_untouched_argmax():
    """The rows the engine may answer with the head's argmax alone (the screened head): plain
    greedy ones; any parameter that changes the logits, or asks for logprobs, says no."""
    plain = {"temperature": 0.0, "max_tokens": 8}
    assert takes_the_argmax(SamplingParams(**plain), 0, False)
    logits = torch.tensor([[0.5, 3.0, 1.0, 3.0]])
    assert sample(logits, [req(**plain)]) == ([1], None)  # the first of ties, untouched
    for changed in (
        {"temperature": 0.7},
        {"logprobs": 1},
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"logit_bias": {2: 5.0}},
    ):
        assert not takes_the_argmax(SamplingParams(**{**plain, **changed}), 0, False), changed
    short = SamplingParams(**plain, min_tokens=2)
    assert not takes_the_argmax(short, 1, False) and takes_the_argmax(short, 2, False)
    assert not takes_the_argmax(SamplingParams(**plain), 0, True)  # a grammar's mask
