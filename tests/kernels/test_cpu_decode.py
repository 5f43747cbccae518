"""The fused fp32 decode forward against the model's own layer-by-layer torch path, at each
instruction-set level, on a small random Llama over GGUF blocks (both kinds, GQA).

Both paths run the same block GEMV for every linear; they differ in the order of the fp32 sums
of the norms, RoPE, softmax and attention. Tolerance: |fused - torch| <= 2e-4 * (1 + the row's
largest |torch|), elementwise, on the last layer's residual stream and on every K/V written (an
fp32 sum's rounding scales with its terms, of the row's order). Measured: ~1e-6 in most rows, up
to 6e-5 in a row whose attention over the random keys is sharply peaked, with the plain loops as
with the vector ones; a wrong head, slot, position or causal bound is O(1).

With fp16 caches both paths store K and V rounded and attend the rounded values: the kernel's
rounding is torch's bit for bit on the same fp32 values, and the two paths' K and V, whose fp32
sums differ in order, are held to the fp32 bound plus one fp16 step.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.gguf_linear import GGUFBlocks
from engine.model import LlamaForCausalLM
from kernels import cpu_decode
from kernels import cpu_quant_gemv as qg
from kernels.cpu_decode import DecodeOptions, Shape
from tests.kernels.test_cpu_quant_gemv import random_blocks

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler")

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIMS = (16, 64)  # the plain loops, and the vector paths' 64-dim V sums
VOCAB, MAX_POS, BLOCK, NUM_BLOCKS = 50, 128, 4, 512
HERE = qg.cpu_flags()
# each layer's linears: (q, k, v) and (gate, up) share a kind, so they fuse; both kinds appear
KINDS = [
    {"qkv": "q4_1", "o": "q8_0", "gate_up": "q4_1", "down": "q8_0"},
    {"qkv": "q8_0", "o": "q4_1", "gate_up": "q8_0", "down": "q4_1"},
]


def small_model(
    head_dim: int = 64, fused_decode: bool = True, kv_heads: int = KV_HEADS
) -> LlamaForCausalLM:
    config = ModelConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=FFN, vocab_size=VOCAB, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=MAX_POS, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.2,
    }
    q, kv = HEADS * head_dim, kv_heads * head_dim
    shapes = {
        "self_attn.q_proj": ("qkv", q, HIDDEN), "self_attn.k_proj": ("qkv", kv, HIDDEN),
        "self_attn.v_proj": ("qkv", kv, HIDDEN), "self_attn.o_proj": ("o", HIDDEN, q),
        "mlp.gate_proj": ("gate_up", FFN, HIDDEN), "mlp.up_proj": ("gate_up", FFN, HIDDEN),
        "mlp.down_proj": ("down", HIDDEN, FFN),
    }  # fmt: skip
    blocks: dict[str, GGUFBlocks] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        weights[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        for j, (name, (group, out, inp)) in enumerate(shapes.items()):
            kind = KINDS[i][group]
            data = random_blocks(kind, out, inp, seed=10 * i + j)
            blocks[p + name + ".weight"] = GGUFBlocks(kind, data)
            weights[p + name + ".weight"] = qg.dequantize(data, kind)
    return LlamaForCausalLM(
        config,
        weights,
        dtype=torch.float32,
        device=torch.device("cpu"),
        blocks=blocks,
        fused_decode=fused_decode,
    )


@pytest.fixture(scope="module", params=HEAD_DIMS, ids=lambda d: f"head_dim {d}")
def model(request) -> LlamaForCausalLM:
    return small_model(request.param)


def random_caches(
    seed: int, head_dim: int, kv_heads: int = KV_HEADS, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V pool filled with random values: the keys before a step's tokens."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, kv_heads, head_dim)
    return [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(LAYERS)
    ]


def step(
    queries: list[tuple[int, int]],  # per sequence: (tokens already cached, new tokens)
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's input ids, positions and metadata; each sequence owns the blocks after the last
    one's, in reverse order (a table is not a range), its table padded with -1."""
    g = torch.Generator().manual_seed(len(queries))
    ids, positions, slots, qlens, slens, tables = [], [], [], [], [], []
    width = max((c + n + BLOCK - 1) // BLOCK for c, n in queries)
    first = 0
    for cached, new in queries:
        own = (cached + new + BLOCK - 1) // BLOCK
        table = list(range(first + own - 1, first - 1, -1)) + [-1] * (width - own)
        first += own
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        ids += torch.randint(0, VOCAB, (new,), generator=g).tolist()
        qlens.append(new)
        slens.append(cached + new)
        tables.append(table)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=qlens,
        seq_lens_cpu=slens,
        block_size=BLOCK,
    )
    return torch.tensor(ids), torch.tensor(positions), attn


def assert_close(got: torch.Tensor, want: torch.Tensor, steps: float = 0.0) -> None:
    """Equal up to fp32 summation order, plus `steps` of the row's largest (a relative error)."""
    assert torch.isfinite(got).all()
    scale = want.abs().amax(dim=-1, keepdim=True)  # each row's terms are of its largest's order
    bound = 2e-4 * (1 + scale) + steps * scale
    worst = float(((got - want).abs() - bound).max())
    assert worst <= 0, f"worst error {worst:.3g} over the bound"


def run_both(
    model: LlamaForCausalLM, queries: list[tuple[int, int]], lib=None, kv_dtype=torch.float32
):
    ids, positions, attn = step(queries)
    d, kvh = model.config.head_dim, model.config.num_kv_heads
    fused_caches = random_caches(1, d, kvh, kv_dtype)
    torch_caches = random_caches(1, d, kvh, kv_dtype)
    fused = model.fused
    assert fused is not None
    if lib is None:
        got = model(ids, positions, fused_caches, attn)
    else:  # a forced level's library, straight to the kernel
        seq_idx = torch.tensor(
            [i for i, n in enumerate(attn.query_lens_cpu) for _ in range(n)], dtype=torch.int32
        )
        ctx = (positions + 1).to(torch.int32)
        x = torch.nn.functional.embedding(ids, model.embed_tokens)
        got = fused.forward(
            x, model.rope_cos, model.rope_sin, positions, attn.slot_mapping, fused_caches,
            attn.block_tables, seq_idx, ctx, lib=lib,
        )  # fmt: skip
    model.fused = None
    try:
        want = model(ids, positions, torch_caches, attn)
    finally:
        model.fused = fused
    return got, want, fused_caches, torch_caches, attn


CASES = {
    "one decode row": [(37, 1)],
    "decode rows of four contexts": [(0, 1), (7, 1), (8, 1), (63, 1)],
    "a prefill chunk beside decode rows": [(5, 12), (30, 1), (0, 1)],
    "drafts to verify": [(20, 4), (9, 4)],
    "thirty-two rows": [(i, 1) for i in range(0, 96, 3)],
}


@pytest.mark.parametrize("case", CASES)
def test_the_fused_forward_is_the_torch_paths_up_to_summation_order(model, case):
    assert_matches_torch(model, CASES[case])


def assert_matches_torch(
    model: LlamaForCausalLM, queries: list[tuple[int, int]], kv_dtype=torch.float32
) -> None:
    got, want, fused_caches, torch_caches, attn = run_both(model, queries, kv_dtype=kv_dtype)
    assert got.shape == want.shape == (sum(attn.query_lens_cpu), HIDDEN)
    # over fp16 caches a K or V whose fp32 value differs in its last bits between the paths
    # (summation order) may round to the neighbouring fp16 value, 2^-10 of its size, and the
    # layers after carry that on: two such steps of each row's largest value are allowed
    assert_close(got, want, steps=2**-9 if kv_dtype == torch.float16 else 0.0)
    logits_got, logits_want = model.compute_logits(got), model.compute_logits(want)
    assert torch.equal(logits_got.argmax(-1), logits_want.argmax(-1))
    slots = attn.slot_mapping
    for (kf, vf), (kt, vt) in zip(fused_caches, torch_caches, strict=True):
        for f, t in ((kf, kt), (vf, vt)):
            assert f.dtype == t.dtype == kv_dtype
            flat_f, flat_t = f.view(-1, *f.shape[2:]), t.view(-1, *t.shape[2:])
            if kv_dtype == torch.float16:  # the fp32 bound, plus one fp16 step
                a, b = flat_f[slots].float(), flat_t[slots].float()
                bound = 2e-4 * (1 + b.abs().amax(dim=-1, keepdim=True)) + b.abs() * 2**-10
                assert ((a - b).abs() <= bound).all()
            else:
                assert_close(flat_f[slots], flat_t[slots])  # this step's K (after RoPE) and V
            keep = torch.ones(flat_f.shape[0], dtype=torch.bool)
            keep[slots] = False
            assert torch.equal(flat_f[keep], flat_t[keep])  # nothing else is written


@pytest.mark.parametrize("case", ["decode rows of four contexts", "a prefill chunk beside decode rows",
                                  "thirty-two rows"])  # fmt: skip
def test_over_fp16_caches_it_is_the_torch_paths_too(model, case):
    assert_matches_torch(model, CASES[case], kv_dtype=torch.float16)


def test_its_fp16_stores_round_as_torch_does(model):
    """Layer 0's K and V do not depend on the cache: over fp32 and fp16 caches the kernel
    computes the same fp32 values, and stores into fp16 exactly torch's .to(float16) of them."""
    ids, positions, attn = step(CASES["a prefill chunk beside decode rows"])
    d, kvh = model.config.head_dim, model.config.num_kv_heads
    wide = random_caches(1, d, kvh)
    half = [(k.half(), v.half()) for k, v in wide]
    model(ids, positions, wide, attn)
    model(ids, positions, half, attn)
    slots = attn.slot_mapping
    for w, h in zip(wide[0], half[0], strict=True):
        stored = h.view(-1, kvh, d)[slots]
        assert torch.equal(stored, w.view(-1, kvh, d)[slots].half())
        assert stored.float().abs().amax() > 0.5  # real values, not zeros


def test_the_model_takes_it_only_for_steps_of_at_most_max_rows(model, monkeypatch):
    calls = []
    monkeypatch.setattr(model.fused, "forward", lambda *a, **k: calls.append(a[0].shape[0]))
    for n in (1, cpu_decode.MAX_ROWS):
        ids, positions, attn = step([(0, n)])
        model(ids, positions, random_caches(0, model.config.head_dim), attn)
    ids, positions, attn = step([(0, cpu_decode.MAX_ROWS + 1)])
    out = model(ids, positions, random_caches(0, model.config.head_dim), attn)  # the torch path
    assert calls == [1, cpu_decode.MAX_ROWS]
    assert out.shape == (cpu_decode.MAX_ROWS + 1, HIDDEN)


def test_it_is_off_when_asked():
    assert small_model(fused_decode=False).fused is None
    assert small_model().fused is not None


def test_one_kv_head_a_query_head_matches_too():
    model = small_model(64, kv_heads=HEADS)  # G = 1: no GQA group
    for case in ("decode rows of four contexts", "a prefill chunk beside decode rows"):
        assert_matches_torch(model, CASES[case])


def test_a_group_of_more_query_heads_than_one_pass_weighs_matches_too():
    model = small_model(64, kv_heads=1)  # G = 4: AVX-512 weighs V for 3 heads, then for 1
    for case in ("decode rows of four contexts", "a prefill chunk beside decode rows"):
        assert_matches_torch(model, CASES[case])


def test_both_attention_splits_match(model):
    """Fewer (token, KV head) items than 4 a thread split by query head, more by KV head: at 1
    thread a 14-token step takes the KV-head split, at 8 the query-head one."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 8):
            torch.set_num_threads(threads)
            for case in ("a prefill chunk beside decode rows", "drafts to verify"):
                assert_matches_torch(model, CASES[case])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("redo_after_ns", [cpu_decode.REDO_AFTER_NS, 0])
def test_items_taken_or_redone_by_any_thread_change_no_bit(model, monkeypatch, redo_after_ns):
    """Each thread takes its own run of a phase's items, then what the others left, and redoes
    what is still open once it has waited redo_after_ns (at 0 every waiting thread races for the
    open items at once; at 8 threads on this machine's cores some are preempted mid-item). An
    item is stored once, by whoever claims it first, and sums the same whoever computes it: at 1,
    2, 3 and 8 threads the residual stream and every K/V written are bit for bit the same (32
    rows: the KV-head attention split at each count)."""
    monkeypatch.setattr(cpu_decode, "REDO_AFTER_NS", redo_after_ns)
    ids, positions, attn = step(CASES["thirty-two rows"])
    d, kvh = model.config.head_dim, model.config.num_kv_heads
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            caches = random_caches(1, d, kvh)
            results.append((model(ids, positions, caches, attn), caches))
    finally:
        torch.set_num_threads(before)
    first, first_caches = results[0]
    for got, caches in results[1:]:
        assert torch.equal(got, first)
        for (k, v), (k0, v0) in zip(caches, first_caches, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_its_counters_count_calls_threads_and_the_work_waited_for(model):
    """One call at 2 threads counts one call and two threads' regions, and the model reports
    the same counters the engine puts in its stats. At 8 threads (4 a core on a bigger
    machine) a thread is now and then preempted mid-item, so others wait for it. Calls are
    repeated until one has, for up to 10 s: a call or two usually does, but while another
    process holds one of two cores the region's first thread can take every item before the
    rest wake, call after call. Whatever was computed twice is counted, never more than the
    step's items."""
    ids, positions, attn = step(CASES["thirty-two rows"])
    d, kvh = model.config.head_dim, model.config.num_kv_heads
    before = torch.get_num_threads()
    many = max(8, 4 * len(os.sched_getaffinity(0)))
    deltas = {}
    try:
        for threads in (2, many):
            torch.set_num_threads(threads)
            first = model.decode_counters()
            give_up = time.monotonic() + (0 if threads == 2 else 10.0)
            while True:
                model(ids, positions, random_caches(1, d, kvh), attn)
                waited = (model.decode_counters() - first).num_waits > 0
                if waited or time.monotonic() > give_up:
                    break
            deltas[threads] = model.decode_counters() - first
    finally:
        torch.set_num_threads(before)
    two, oversubscribed = deltas[2], deltas[many]
    calls = oversubscribed.num_calls
    assert (two.num_calls, two.num_thread_calls) == (1, 2)
    assert calls >= 1 and oversubscribed.num_thread_calls == many * calls
    assert oversubscribed.num_waits > 0 and oversubscribed.wait_ns > 0
    phases = model.config.num_layers * 9
    assert two.num_waits <= 2 * phases and oversubscribed.num_waits <= many * phases * calls
    rows = 32  # the step's items at most: every phase's items, each computed by every thread
    bound = (many - 1) * phases * rows * model.config.num_heads * calls
    assert 0 <= oversubscribed.num_dropped <= bound


def test_a_row_sums_the_same_whichever_many_rows_share_its_step(model):
    """From OUTER_MIN_ROWS (28) rows the linears take the rows as vector lanes (AVX-512;
    below it, and at other levels, the GEMV's panels): each lane's sums are its own row's, so a
    row comes out bit for bit the same in a step of 32 rows as in one of 28 or 30, and so do the
    K and V it writes."""
    rows = CASES["thirty-two rows"]
    d, kvh = model.config.head_dim, model.config.num_kv_heads
    full_ids, positions, attn = step(rows)
    full_caches = random_caches(1, d, kvh)
    full = model(full_ids, positions, full_caches, attn)
    for n in (28, 30):
        _, positions, attn = step(rows[:n])  # one new token a sequence: the first n ids
        caches = random_caches(1, d, kvh)
        got = model(full_ids[:n], positions, caches, attn)
        assert torch.equal(got, full[:n]), f"a row changed between steps of 32 and {n} rows"
        for (k, v), (k0, v0) in zip(caches, full_caches, strict=True):
            slots = attn.slot_mapping
            assert torch.equal(k.view(-1, kvh, d)[slots], k0.view(-1, kvh, d)[slots])
            assert torch.equal(v.view(-1, kvh, d)[slots], v0.view(-1, kvh, d)[slots])


def test_it_refuses_caches_and_inputs_of_another_shape(model):
    d = model.config.head_dim
    ids, positions, attn = step([(3, 1)])
    caches = random_caches(0, d)
    caches[1] = (caches[1][0][: NUM_BLOCKS // 2].contiguous(), caches[1][1])  # fewer blocks
    with pytest.raises(ValueError, match="every one must be"):
        model(ids, positions, caches, attn)
    caches = random_caches(0, d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KV caches of torch.bfloat16: the fused forward takes"):
        model(ids, positions, caches, attn)
    caches = random_caches(0, d)
    caches[1] = (caches[1][0].half(), caches[1][1].half())  # one layer's of another dtype
    with pytest.raises(ValueError, match="all torch.float32"):
        model(ids, positions, caches, attn)
    x = torch.zeros(1, HIDDEN // 2)
    seq, ctx = torch.zeros(1, dtype=torch.int32), (positions + 1).to(torch.int32)
    with pytest.raises(ValueError, match="x must be"):
        model.fused.forward(x, model.rope_cos, model.rope_sin, positions, attn.slot_mapping,
                            random_caches(0, d), attn.block_tables, seq, ctx)  # fmt: skip
    x = torch.zeros(1, HIDDEN)
    with pytest.raises(ValueError, match="cos must be"):
        model.fused.forward(x, model.rope_cos[:, : d // 2], model.rope_sin, positions,
                            attn.slot_mapping, random_caches(0, d), attn.block_tables, seq, ctx)  # fmt: skip


def test_an_index_out_of_range_is_refused_before_anything_is_written(model):
    ids, positions, attn = step([(6, 2)])
    caches = random_caches(2, model.config.head_dim)
    before = [(k.clone(), v.clone()) for k, v in caches]
    attn.slot_mapping[1] = NUM_BLOCKS * BLOCK  # one past the pool
    with pytest.raises(IndexError, match="out of range"):
        model(ids, positions, caches, attn)
    attn.slot_mapping[1] = 0
    attn.block_tables[0, 0] = NUM_BLOCKS  # a block id past the pool, in the keys' span
    with pytest.raises(IndexError, match="out of range"):
        model(ids, positions, caches, attn)
    attn.block_tables[0, 0] = -1  # a table's padding, inside the keys' span
    with pytest.raises(IndexError, match="out of range"):
        model(ids, positions, caches, attn)
    ids, positions, attn = step([(6, 2)])
    positions[1] = MAX_POS  # past the RoPE tables
    with pytest.raises(IndexError, match="out of range"):
        model(ids, positions, caches, attn)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32 KV", "fp16 KV"])
@pytest.mark.parametrize("level", qg.ISA_LEVELS)
def test_each_forced_level_matches_the_torch_path(model, level, kv_dtype):
    if not qg.ISA_NEEDS[level] <= HERE and qg.is_x86():
        pytest.skip(f"this CPU lacks {sorted(qg.ISA_NEEDS[level] - HERE)}")
    cpu_decode.configure(DecodeOptions(isa=level))
    try:
        lib = cpu_decode.load()
        assert lib is not None
        if qg.is_x86():
            assert cpu_decode.library_isa(lib) == level  # the path it was asked for
        for case in ("decode rows of four contexts", "a prefill chunk beside decode rows"):
            got, want, *_ = run_both(model, CASES[case], lib=lib, kv_dtype=kv_dtype)
            assert_close(got, want)
    finally:
        cpu_decode.configure(DecodeOptions())


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        (Shape(64, 4, 2, 258, 96, 1e-5), "head_dim 258"),
        (Shape(64, 4, 2, 15, 96, 1e-5), "head_dim 15"),
        (Shape(64, 34, 2, 16, 96, 1e-5), "34 heads over 2 KV heads"),
        (Shape(64, 4, 3, 16, 96, 1e-5), "4 heads over 3 KV heads"),
        (Shape(48, 4, 2, 16, 96, 1e-5), "hidden 48"),
        (Shape(64, 4, 2, 16, 80, 1e-5), "ffn 80"),
    ],
)
def test_it_refuses_shapes_it_cannot_compute(shape, reason):
    assert reason in (shape.refusal() or "")
    with pytest.raises(ValueError, match=reason):
        cpu_decode.DecodeForward(shape, [])
