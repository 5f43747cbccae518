"""`brigade bench quality`: the plain reference equals the engine's fp32 model, the teacher-forced
passes score what they should, the chat comparison finds the first differing token, and the
table marks each row against the targets."""

import json

import pytest
import torch

from engine.loader import load_model, read_hf_dir
from tests.engine.tiny_llama import write_tiny_llama
from tools.bench.quality import (
    CORPUS,
    PROMPTS,
    FlippedMargins,
    compare_answers,
    first_divergence,
    markdown,
    meets_targets,
    with_margins,
)
from tools.bench.quality_forced import Reference, forced_logits, score, split_segments
from tools.bench.quality_reference import ReferenceLlama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("llama"))
    config, weights = read_hf_dir(path)
    g = torch.Generator().manual_seed(1)
    corpus = torch.randint(3, config.vocab_size, (200,), generator=g).tolist()
    segments = split_segments(corpus, 50, None)
    ref = Reference(segments, config.vocab_size)
    model = ReferenceLlama(config, weights)
    ref.fill(model, segments)
    yield path, segments, ref, model
    ref.close()


def test_segments_cover_the_corpus_and_drop_unscorable_tails():
    assert split_segments(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split_segments(list(range(9)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_segments(list(range(10)), 4, 6) == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("streams,per_step", [(1, 16), (4, 1), (2, 3)])
def test_fp32_engine_model_matches_the_plain_reference_on_every_path(tiny, streams, per_step):
    path, segments, ref, _ = tiny
    model, _ = load_model(str(path), dtype="float32", quantization=None)
    s = score(
        ref, segments, forced_logits(model, segments, num_streams=streams, tokens_per_step=per_step)
    )
    assert s["num_positions"] == sum(len(x) - 1 for x in segments)
    assert s["top1"] == 1.0
    assert s["mean_kl"] < 1e-6  # fp32 sums in another order: ~4e-8
    assert s["ppl"] == pytest.approx(s["ref_ppl"], rel=1e-5)


def test_a_perturbed_model_scores_worse(tiny):
    path, segments, ref, _ = tiny
    model, _ = load_model(str(path), dtype="float32", quantization=None)
    with torch.no_grad():
        model.norm.mul_(torch.linspace(0.5, 1.5, model.norm.shape[0]))
    s = score(ref, segments, forced_logits(model, segments, num_streams=1, tokens_per_step=64))
    assert s["mean_kl"] > 1e-3
    assert s["top1"] < 1.0
    assert s["first_flips"] and all(0 <= seg < len(segments) for seg, _ in s["first_flips"])


def test_first_divergence_and_answer_comparison():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    c = compare_answers([[1, 2], [3, 4], [5, 6, 7]], [[1, 2], [3, 9], [5, 6]])
    assert c["identical"] == 1
    assert c["first_divergence"] == [None, 1, 2]
    assert c["median_first_divergence"] == 1.5


def test_a_flip_is_scored_by_the_reference_models_own_margin(tiny):
    *_, model = tiny
    prompt = [5, 9, 13, 2]
    ranked = model.logits(prompt)[-1].argsort(descending=True).tolist()
    best, second, worst = ranked[0], ranked[1], ranked[-1]
    reference = [[best, 7], [best], [best, 3]]
    answers = [[best, 7], [second], [worst, 3]]  # identical, a near flip, the worst token
    margins = FlippedMargins(model, [prompt] * 3, reference)
    got = margins.of(answers, compare_answers(reference, answers)["first_divergence"])
    row = model.logits(prompt)[-1]
    assert got[0] is None
    assert got[1] == pytest.approx(float(row[best] - row[second]), abs=1e-6) and got[1] > 0
    assert got[2] == pytest.approx(float(row[best] - row[worst]), abs=1e-6) and got[2] > got[1]
    again = margins.of(answers, compare_answers(reference, answers)["first_divergence"])
    assert again == got and len(margins._logits) == 2  # another row's flips at the same places
    ended = margins.of([[best]], [1])  # one answer ends sooner: no token to compare
    assert ended == [None]
    chat = with_margins(compare_answers(reference, answers), got)
    assert chat["widest_flipped_margin"] == got[2]


def _tf(kl: float, top1: float) -> dict:
    one = {"mean_kl": kl, "top1": top1, "ppl": 20.0, "ref_ppl": 20.0}
    return {"prefill": one, "decode": dict(one), "decode_wide": dict(one)}


def test_targets_need_every_path():
    assert meets_targets(_tf(0.0005, 0.995))
    assert not meets_targets(_tf(0.0015, 0.995))
    assert not meets_targets(_tf(0.0005, 0.985))
    bad_decode = _tf(0.0005, 0.995)
    bad_decode["decode"]["top1"] = 0.97
    assert not meets_targets(bad_decode)
    bad_wide = _tf(0.0005, 0.995)  # 32 rows a step: the fused forward's lanes at AVX-512
    bad_wide["decode_wide"]["mean_kl"] = 0.002
    assert not meets_targets(bad_wide)
    assert meets_targets(None) is None


def test_table_has_a_row_per_config_and_says_which_meet_the_targets():
    chat = {"num_prompts": 64, "identical": 60, "median_first_divergence": 7}
    res = {
        "model": "m",
        "threads": 2,
        "wall_s": 1.0,
        "corpus": {"file": "c.txt", "tokens": 9000, "segments": 8},
        "prompts": 64,
        "max_tokens": 64,
        "targets": {"top1": 0.99, "mean_kl": 0.001},
        "llama_cpp": None,
        "rows": [
            {
                "name": "default (float32 dense)",
                "teacher_forced": _tf(0.0, 1.0),
                "chat": chat,
                "meets_targets": True,
            },
            {
                "name": "bfloat16 int8",
                "teacher_forced": _tf(0.0069, 0.943),
                "chat": {**chat, "widest_flipped_margin": 0.3125},
                "meets_targets": False,
            },
            {
                "name": "default + prefix cache",
                "teacher_forced": None,
                "chat": chat,
                "meets_targets": None,
            },
        ],
    }
    table = markdown(res)
    assert "| default (float32 dense) | 0.00000 | 100.00 % | 20.000 |" in table
    assert "| bfloat16 int8 | 0.00690 | 94.30 % |" in table
    assert "| 60/64 | 7 | 0.31 | no |" in table
    assert "| 60/64 | 7 | — | yes |" in table  # no flip measured
    assert "| 20.000 | 0.00690 | 94.30 % | 60/64 |" in table  # the 32-stream decode columns
    assert "llama.cpp: skipped" in table
    answers = {"chat": {**chat, "identical": 50, "median_first_divergence": 4}, "answers": []}
    table = markdown({**res, "llama_cpp": answers})
    assert "identical to the fp32 reference's: 50/64; median first divergence 4" in table
    assert "widest margin flipped — nats" in table


def test_llama_cpp_answers_say_why_without_a_llama_server(tmp_path):
    from tools.bench.quality import llama_cpp_answers

    why = llama_cpp_answers(tmp_path, tmp_path / "m.gguf", [[1, 2]], 4)
    assert isinstance(why, str) and "no llama.cpp build under" in why


def test_the_shipped_set_is_big_enough():
    assert len(CORPUS.read_text()) > 30_000
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    assert len(prompts) >= 64 and len(set(prompts)) == len(prompts)
