"""Engine: add_request / step / abort on a tiny random Llama and on the real SmolLM2 (fp32, and
the batch-invariant mode in bf16 and fp32)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from kernels import cpu_greedy_head
from tests.engine.tiny_llama import write_tiny_llama

PROMPT_LENS = [3, 17, 40, 9, 25, 60, 5, 33]  # eight requests of different lengths
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = [  # SmolLM2 prompts of different lengths and kinds
    "The capital of France is",
    "Write a haiku about the sea. It goes",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The three primary colors are",
    "Hello",
    "A list of fruits: apple, banana,",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def tiny_engine(model: Path, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    return Engine(EngineConfig(model=str(model), dtype="float32", block_size=4, **kw))


def prompts(lens, vocab):
    return [[(7 * i + 13 * n) % (vocab - 3) + 3 for i in range(n)] for n in lens]


def run_all(engine, token_lists, params, ids=None):
    """Add every prompt at once, step to completion; -> output ids per request, steps taken."""
    ids = ids or [f"r{i}" for i in range(len(token_lists))]
    for rid, toks in zip(ids, token_lists, strict=True):
        engine.add_request(rid, toks, params)
    out = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
    return [out[rid] for rid in ids], steps


def alone(engine, token_lists, params):
    return [run_all(engine, [t], params, [f"alone{i}"])[0][0] for i, t in enumerate(token_lists)]


def test_greedy_same_alone_batched_chunked_and_preempted(tiny_dir):
    engine = tiny_engine(tiny_dir)
    toks = prompts(PROMPT_LENS, engine.model_config.vocab_size)
    expected = alone(engine, toks, GREEDY)
    assert all(len(e) == 12 for e in expected) and len({tuple(e) for e in expected}) == 8

    batched, _ = run_all(engine, toks, GREEDY)
    assert batched == expected

    chunked = tiny_engine(tiny_dir, max_num_batched_tokens=16, max_num_seqs=8)
    out, steps = run_all(chunked, toks, GREEDY)
    assert out == expected
    assert steps >= sum(PROMPT_LENS) // 16  # the prompts really were prefilled in chunks

    # 20 blocks x 4 tokens = 80 slots for 192 prompt tokens + 96 generated: preemption is certain
    tight = tiny_engine(tiny_dir, num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=8)
    out, _ = run_all(tight, toks, GREEDY)
    assert out == expected
    assert tight.stats().num_preemptions > 0
    assert tight.stats().num_free_blocks == 20


def test_decodes_get_a_token_every_step_while_a_long_prompt_prefills(tiny_dir):
    engine = tiny_engine(tiny_dir, max_num_batched_tokens=8, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params, priority=1)
    assert [o.request_id for o in engine.step()] == ["short"]
    # an interactive 80-token prompt runs ahead of the batch decode, but the decode keeps
    # one token of the 8-token budget every step: the prompt takes 7 per step, 12 steps
    engine.add_request("long", list(range(3, 83)), params, priority=0)
    per_step = [[o.request_id for o in engine.step()] for _ in range(12)]
    assert all("short" in ids for ids in per_step)
    assert [i for i, ids in enumerate(per_step) if "long" in ids] == [11]


def test_seeded_sampling_reproducible_alone_and_batched_and_seed_assigned(tiny_dir):
    engine = tiny_engine(tiny_dir)
    toks = prompts(PROMPT_LENS, engine.model_config.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    expected = alone(engine, toks, params)
    batched, _ = run_all(engine, toks, params)
    assert batched == expected
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    seed = engine.add_request("x", toks[0], unseeded)
    got = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.seed == seed for o in outs)
        got += [t for o in outs for t in o.new_token_ids]
    again = run_all(engine, [toks[0]], dataclasses.replace(unseeded, seed=seed))[0][0]
    assert got == again


def test_abort_frees_blocks_at_once_and_reports_next_step(tiny_dir):
    engine = tiny_engine(tiny_dir, num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", list(range(3, 13)), params)  # 10 tokens -> 3 blocks
    engine.add_request("b", list(range(3, 8)), params)  # 5 tokens -> 2 blocks
    engine.step()
    engine.step()  # a: 12 tokens (3 blocks), b: 7 tokens (2 blocks)
    assert engine.stats().num_free_blocks == 27
    assert engine.abort_request("a") is True
    assert engine.stats().num_free_blocks == 30 and engine.stats().num_running == 1
    assert engine.abort_request("a") is False and engine.abort_request("nope") is False
    outs = engine.step()
    assert (outs[0].request_id, outs[0].finished, outs[0].finish_reason) == ("a", True, "abort")
    assert outs[0].num_output_tokens == 2 and [o.request_id for o in outs[1:]] == ["b"]
    engine.abort_request("b")
    assert engine.stats().num_free_blocks == 32
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests()


def test_add_request_rejects_what_can_never_run(tiny_dir):
    engine = tiny_engine(tiny_dir, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match=r"= 70 > max_model_len 64"):
        engine.add_request("a", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"needs 10 KV blocks but the cache has 8"):
        engine.add_request("a", [5] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"outside \[0, 259\): \[300\]"):
        engine.add_request("a", [5, 300], SamplingParams())
    with pytest.raises(ValueError, match="prompt has no tokens"):
        engine.add_request("a", [], SamplingParams())
    engine.add_request("a", [5], SamplingParams())
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("a", [5], SamplingParams())


def test_logprobs_and_stats(tiny_dir):
    engine = tiny_engine(tiny_dir, num_kv_blocks=16)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, logprobs=3))
    out = engine.step()[0]
    (lp,) = out.new_logprobs
    assert lp[0][0] == out.new_token_ids[0] == lp[1][0]  # greedy: the sampled token is the top-1
    assert len(lp) == 4 and lp[1][1] >= lp[2][1] >= lp[3][1]
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks) == (1, 0, 15, 16)
    assert s.kv_usage == pytest.approx(1 / 16)


# four prompts of 5, 10, 19 and 9 tokens: within a 32-token step budget the 19-token one is
# prefilled in two chunks beside the others
FOUR_TEXTS = [TEXTS[0], TEXTS[1], TEXTS[4], TEXTS[7]]


def test_smollm2_greedy_same_alone_and_batched_with_chunks_and_preemption():
    engine = Engine(
        EngineConfig(
            dtype="float32",
            block_size=16,
            num_kv_blocks=5,
            max_num_batched_tokens=32,
            max_num_seqs=8,
        )
    )
    tok = engine.tokenizer
    toks = [tok.encode(t) for t in FOUR_TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batched, _ = run_all(engine, toks, params)
    assert engine.stats().num_preemptions > 0  # 80 KV slots for 43 prompt + 32 new tokens
    assert batched == alone(engine, toks, params)
    assert tok.decode(batched[0]).strip().startswith("Paris")


def test_smollm2_greedy_through_the_screened_head_gives_the_whole_heads_tokens(monkeypatch):
    """Plain greedy steps take each row's token from the screened head (where the CPU has AVX-512
    VNNI), steps with a row that needs its logits the whole head: the same tokens either way, with
    n-gram drafts verified against the rows' argmaxes, and a request asking for logprobs."""
    on = Engine(EngineConfig(dtype="float32", num_speculative_tokens=3))
    off = Engine(EngineConfig(dtype="float32", num_speculative_tokens=3, screened_head=False))
    assert off.model.greedy_head is None
    assert (on.model.greedy_head is not None) == cpu_greedy_head.fast()
    screened = []
    if on.model.greedy_head is not None:
        head = on.model.greedy_head
        real = head.argmax
        monkeypatch.setattr(head, "argmax", lambda h: screened.append(h.shape[0]) or real(h))
    toks = [on.tokenizer.encode(t) for t in TEXTS + ["1, 2, 3, 1, 2, 3, 1, 2,"] * 2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert run_all(on, toks, params)[0] == run_all(off, toks, params)[0]
    if cpu_greedy_head.fast():
        assert max(screened) >= 10  # 10 rows a step at least, drafts' rows among them
    with_logprobs = dataclasses.replace(params, logprobs=2)
    got = []
    for engine in (on, off):
        engine.add_request("lp", toks[0], with_logprobs)  # beside three plain greedy ones
        for i, t in enumerate(toks[1:4]):
            engine.add_request(f"g{i}", t, params)
        out: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.request_id == "lp" and o.new_token_ids:
                    out.setdefault("lp logprobs", []).extend(o.new_logprobs)
        got.append(out)
    assert got[0] == got[1] and len(got[0]["lp"]) == len(got[0]["lp logprobs"]) == 16


@pytest.mark.parametrize(
    ("dtype", "quantization"),  # dense bf16 GEMMs; int4 GEMVs; fp32 block GEMVs
    [("bfloat16", "auto"), ("bfloat16", "int4"), ("float32", "auto")],
)
def test_smollm2_batch_invariant_gives_the_same_bits_alone_batched_and_preempted(
    dtype, quantization
):
    """The CPU is batch-invariant only in this mode: in bf16 one GEMM kernel at every row
    count, a one-row input computed as two; in fp32 the block GEMV at every row count; attention
    one query token at a time. Token ids and logprobs (floats), greedy and seeded, must be
    identical alone, with three others, chunked and after preemption (with the mode off they
    differ: the logprobs at the first batched step already)."""
    engine = Engine(
        EngineConfig(
            dtype=dtype,
            batch_invariant=True,
            quantization=quantization,
            num_kv_blocks=6,
            max_num_batched_tokens=32,
            max_num_seqs=8,
        )
    )
    tok = engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    seeded = dataclasses.replace(greedy, temperature=0.8, top_p=0.9)  # odd TEXTS: sampled

    def run(requests):  # -> {request id: (token ids, logprobs)}
        for rid, text in requests:
            i = TEXTS.index(text)
            params = dataclasses.replace(seeded, seed=i) if i % 2 else greedy
            engine.add_request(rid, tok.encode(text), params)
        out = {rid: ([], []) for rid, _ in requests}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id][0].extend(o.new_token_ids)
                out[o.request_id][1].extend(o.new_logprobs)
        return out

    batched = run([(f"b{i}", t) for i, t in enumerate(FOUR_TEXTS)])  # 2 greedy, 2 seeded
    assert engine.stats().num_preemptions > 0  # 96 KV slots for 43 prompt + 64 new tokens
    for i, text in enumerate(FOUR_TEXTS):
        assert run([(f"a{i}", text)])[f"a{i}"] == batched[f"b{i}"], text
    assert tok.decode(batched["b0"][0]).strip().startswith("Paris")


def test_prefix_caching_reuses_blocks_and_changes_no_bit(tiny_dir):
    """Requests sharing a 40-token system prefix, run after one that computed it: with the
    cache they skip the shared full blocks and give bit-identical tokens and logprobs (bf16,
    batch-invariant, so that any difference would be the cache's), preempted ones included."""
    system = prompts([40], 200)[0]
    tails = prompts([3, 9, 1, 14, 6], 50)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)

    def run(caching: bool):
        engine = Engine(
            EngineConfig(
                model=str(tiny_dir),
                dtype="bfloat16",
                batch_invariant=True,
                block_size=4,
                num_kv_blocks=24,
                max_num_batched_tokens=24,
                max_num_seqs=8,
                enable_prefix_caching=caching,
            )
        )
        first, _ = run_all(engine, [system + [7]], params, ["first"])
        out = {}
        for rid, toks in zip("abcde", tails, strict=True):
            engine.add_request(rid, system + toks, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                ids, lps = out.setdefault(o.request_id, ([], []))
                ids += o.new_token_ids
                lps += o.new_logprobs
                cached_tokens[o.request_id] = o.num_cached_tokens
                preempted[o.request_id] = o.num_preemptions
        return first, out, engine.stats()

    cached_tokens: dict[str, int] = {}
    preempted: dict[str, int] = {}

    plain_first, plain, plain_stats = run(False)
    first, cached, stats = run(True)
    assert (first, cached) == (plain_first, plain)
    assert plain_stats.num_prefix_hits == 0
    assert stats.num_preemptions > 0  # 96 KV slots: 10 shared blocks + each request's own
    # the first request computes everything; each later one finds at least the 10 full blocks
    # of the system prompt (a preempted one may find its own blocks again)
    assert stats.num_prefix_hits >= 5 * 40
    assert all(n >= 40 for n in cached_tokens.values())  # each request's own count, reported
    assert sum(preempted.values()) == stats.num_preemptions  # each run says how often
    assert 1 <= stats.num_step_tokens <= 24


def test_min_tokens_masks_stop_ids_until_reached(tiny_dir):
    engine = tiny_engine(tiny_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    free, _ = run_all(engine, [[5, 6, 7]], greedy, ["free"])
    stop = free[0][0]  # the first greedy token becomes a stop id
    stopped, _ = run_all(
        engine, [[5, 6, 7]], dataclasses.replace(greedy, stop_token_ids=(stop,)), ["s"]
    )
    assert stopped[0] == [stop]
    held = dataclasses.replace(greedy, stop_token_ids=(stop,), min_tokens=3)
    engine.add_request("held", [5, 6, 7], held)
    got, reason = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            got += o.new_token_ids
            reason = o.finish_reason
    assert stop not in got[:3] and len(got) >= 3
    assert (reason == "stop") == (stop in got) and (got[-1] == stop or len(got) == 6)


def test_logit_bias_forces_and_bans_tokens_and_is_checked_against_the_vocabulary(tiny_dir):
    engine = tiny_engine(tiny_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    free, _ = run_all(engine, [[5, 6, 7]], greedy, ["free"])
    forced, _ = run_all(engine, [[5, 6, 7]], dataclasses.replace(greedy, logit_bias={42: 100}),
                        ["forced"])  # fmt: skip
    assert forced[0] == [42] * 5 != free[0]
    ban = {t: -100 for t in free[0]}
    banned, _ = run_all(engine, [[5, 6, 7]], dataclasses.replace(greedy, logit_bias=ban), ["b"])
    assert not set(banned[0]) & set(free[0])
    with pytest.raises(ValueError, match=r"logit_bias names ids outside the vocabulary"):
        engine.add_request("x", [5], SamplingParams(logit_bias={259: 1.0}))


def _first_output(engine, rid, toks, params):
    engine.add_request(rid, toks, params)
    first = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            first = first or o
    return first


def test_prompt_logprobs_equal_each_position_sampled_alone_chunked_and_past_the_cache(tiny_dir):
    """Entry k is prompt token k + 1 with its logprob, then the top-2 at position k: the same
    as a request of prompt[:k + 1] forced (logit_bias) to sample that token; computed in
    chunks of 5 tokens and with the prompt's blocks in the prefix cache, unchanged."""
    vocab_engine = tiny_engine(tiny_dir)
    toks = prompts([11], vocab_engine.model_config.vocab_size)[0]
    ref = []
    for k in range(len(toks) - 1):
        forced = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2,
                                logit_bias={toks[k + 1]: 100})  # fmt: skip
        ref.append(_first_output(vocab_engine, f"p{k}", toks[: k + 1], forced).new_logprobs[0])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    for kw in (
        {},
        {"max_num_batched_tokens": 5, "max_num_seqs": 4},
        {"enable_prefix_caching": True},
    ):
        engine = tiny_engine(tiny_dir, **kw)
        if kw.get("enable_prefix_caching"):
            _first_output(engine, "warm", toks, SamplingParams(max_tokens=1))
        got = _first_output(engine, "r", toks, params).prompt_logprobs
        assert [e[0][0] for e in got] == toks[1:]
        for entry, want in zip(got, ref, strict=True):
            assert [t for t, _ in entry] == [t for t, _ in want]
            assert [lp for _, lp in entry] == pytest.approx([lp for _, lp in want], abs=1e-4)
        if kw.get("enable_prefix_caching"):
            assert engine.scheduler.num_prefix_hits == 0  # computed whole, not from the cache


def test_parallel_samples_share_the_prompts_blocks_and_prefill_them_once(tiny_dir):
    """n = 3 by fork: the children wait for the parent's prompt, then hold its full blocks
    (the same block ids, ref count 3) and compute only the last partial block; each sample is
    the one it gets on its own with its seed."""
    toks = prompts([23], 259)[0]  # 5 full blocks of 4 and 3 tokens
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=6) for s in (1, 2, 3)]
    alone_out = [run_all(tiny_engine(tiny_dir), [toks], p, ["a"])[0][0] for p in sampled]
    engine = tiny_engine(tiny_dir)
    computed: dict[str, int] = {}
    run = engine.runner.run

    def counting(scheduled, **kw):
        for s in scheduled:
            computed[s.seq.request_id] = computed.get(s.seq.request_id, 0) + s.num_real_tokens
        return run(scheduled, **kw)

    engine.runner.run = counting
    engine.add_request("p", toks, sampled[0])
    engine.add_request("c1", toks, sampled[1], fork_of="p")
    engine.add_request("c2", toks, sampled[2], fork_of="p")
    out = {rid: [] for rid in ("p", "c1", "c2")}
    shared = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        seqs = engine._seqs
        if shared is None and "c1" in seqs and seqs["c1"].block_table:
            shared = seqs["p"].block_table[:5]
            assert seqs["c1"].block_table[:5] == seqs["c2"].block_table[:5] == shared
            assert [engine.block_manager.ref_counts[b] for b in shared] == [3] * 5
    assert shared is not None
    assert engine.scheduler.num_forked_tokens == engine.stats().num_forked_tokens == 2 * 20
    assert computed["p"] == 23 + 5 and computed["c1"] == computed["c2"] == 3 + 5
    assert [out["p"], out["c1"], out["c2"]] == alone_out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.add_request("x", toks, sampled[0], fork_of="gone")  # no such parent: on its own
    assert engine._seqs["x"].fork_parent is None


def test_engine_config_is_validated():
    with pytest.raises(ValueError, match=r"EngineConfig.dtype='fp8'; allowed: \['bfloat16'"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="EngineConfig.block_size=0; allowed: >= 1"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="EngineConfig.num_kv_blocks=0; allowed: None or >= 1"):
        EngineConfig(num_kv_blocks=0)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'; allowed: auto, float32, bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")
    for refused in (
        {"dtype": "bfloat16", "kv_cache_dtype": "float16"},
        {"kv_cache_dtype": "bfloat16"},
        {"kv_cache_dtype": "float16", "device": "cuda"},
        {"kv_cache_dtype": "float16", "batch_invariant": True},
    ):
        with pytest.raises(ValueError, match="float16 under float32, on the CPU, without batch"):
            EngineConfig(**refused)
    EngineConfig(kv_cache_dtype="float32")  # the model's own dtype, named
    EngineConfig(dtype="bfloat16", kv_cache_dtype="bfloat16")


def test_an_fp16_kv_cache_holds_twice_the_tokens_and_answers_as_fp32(tiny_dir):
    """The same budget holds twice the blocks of fp16; the tiny model (torch's SDPA over the
    gathered blocks, widened to fp32) greedily answers eight prompts as with the fp32 cache."""
    budget = {"num_kv_blocks": None, "kv_cache_memory_bytes": 1 << 20}
    wide = tiny_engine(tiny_dir, **budget)
    half = tiny_engine(tiny_dir, kv_cache_dtype="float16", **budget)
    assert half.block_manager.num_blocks == 2 * wide.block_manager.num_blocks
    assert {c.dtype for kv in half.kv_cache.kv_caches for c in kv} == {torch.float16}
    assert half.kv_cache.nbytes == wide.kv_cache.nbytes
    toks = prompts(PROMPT_LENS, wide.model_config.vocab_size)
    assert run_all(half, toks, GREEDY) == run_all(wide, toks, GREEDY)


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "layer by layer"])
def test_smollm2_with_an_fp16_kv_cache_answers_as_with_fp32(fused_decode):
    """SmolLM2's greedy tokens for eight prompts, decoded together, on the fused forward (its
    C stores and reads of fp16) and layer by layer: those of the fp32 cache."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    wide = Engine(EngineConfig(dtype="float32", num_kv_blocks=64))
    half = Engine(
        EngineConfig(
            dtype="float32", num_kv_blocks=64, kv_cache_dtype="float16", fused_decode=fused_decode
        )
    )
    assert (half.model.fused is not None) == fused_decode
    toks = [wide.tokenizer.encode(t) for t in TEXTS]
    want, _ = run_all(wide, toks, params)
    assert run_all(half, toks, params)[0] == want
    assert wide.tokenizer.decode(want[0]).strip().startswith("Paris")


def continued(engine, prompt, params, cut, rid):
    """The first `cut` tokens of a run, then the rest as a continuation (prompt + those tokens,
    num_prior_output=cut, max_tokens reduced): what a worker taking over from the log runs."""
    engine.add_request(rid, prompt, dataclasses.replace(params, max_tokens=cut))
    head = []
    while engine.has_unfinished_requests():
        head += [t for o in engine.step() for t in o.new_token_ids]
    rest = dataclasses.replace(params, max_tokens=params.max_tokens - cut)
    engine.add_request(rid + "+", prompt + head, rest, num_prior_output=len(head))
    tail = []
    while engine.has_unfinished_requests():
        tail += [t for o in engine.step() for t in o.new_token_ids]
    return head + tail


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True,
            repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
        ),
    ],
    ids=["greedy", "seeded", "seeded-penalized"],
)  # fmt: skip
def test_a_continuation_from_the_logged_tokens_samples_what_the_run_would_have(tiny_dir, params):
    """Each draw is keyed by (seed, output position), and penalties count the prior output as
    output: cut anywhere and continued, the run's tokens are the uninterrupted run's."""
    engine = tiny_engine(tiny_dir)
    prompt = prompts([9], engine.model_config.vocab_size)[0]
    [whole], _ = run_all(engine, [prompt], params, ["whole"])
    assert len(whole) == 20
    for cut in (1, 7, 19):
        assert continued(engine, prompt, params, cut, f"cut{cut}") == whole, cut


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_batch_invariant_continuation_is_the_uninterrupted_decode_bit_for_bit(dtype):
    """A worker taking over from the log prefills prompt + stored tokens, in chunks and beside
    another request, where the uninterrupted run decoded them one at a time alone: in the
    batch-invariant mode the tokens after the cut and their logprobs are the same bits, greedy
    and seeded."""
    engine = Engine(
        EngineConfig(
            dtype=dtype,
            batch_invariant=True,
            num_kv_blocks=16,
            max_num_batched_tokens=16,  # the continuation's prefill goes in chunks
            max_num_seqs=4,
        )
    )
    tok = engine.tokenizer
    prompt, other = tok.encode(TEXTS[4]), tok.encode(TEXTS[1])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = dataclasses.replace(greedy, temperature=0.8, top_p=0.9, seed=3)

    def run(requests):  # [(request id, prompt, params, num_prior_output)] -> {id: [(tok, lps)]}
        for rid, ids, params, prior in requests:
            engine.add_request(rid, ids, params, num_prior_output=prior)
        out = {rid: [] for rid, *_ in requests}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += zip(o.new_token_ids, o.new_logprobs, strict=True)
        return out

    for params in (greedy, seeded):
        whole = run([("whole", prompt, params, 0)])["whole"]
        for cut in (1, 6, 11):
            head = [t for t, _ in whole[:cut]]
            rest = dataclasses.replace(params, max_tokens=params.max_tokens - cut)
            out = run([("beside", other, greedy, 0), ("cont", prompt + head, rest, cut)])
            assert out["cont"] == whole[cut:], (params.temperature, cut)


def test_draws_depend_on_seed_and_position_only():
    from engine.sampler import draw_seed

    seeds = {draw_seed(s, p) for s in (0, 1, 2**62) for p in range(50)}
    assert len(seeds) == 150 and all(0 <= x < 2**63 for x in seeds)
    assert draw_seed(5, 3) == draw_seed(5, 3)


def test_num_prior_output_must_leave_a_prompt(tiny_dir):
    engine = tiny_engine(tiny_dir)
    with pytest.raises(ValueError, match="num_prior_output=3"):
        engine.add_request("a", [5, 6, 7], SamplingParams(), num_prior_output=3)
    with pytest.raises(ValueError, match="num_prior_output=-1"):
        engine.add_request("a", [5, 6, 7], SamplingParams(), num_prior_output=-1)
