"""The compiled CPU paged-attention kernel against the slow reference over the same blocks, and
every token of a step as one query: causal attention, chunking changes no bit; bf16 and fp32."""

from __future__ import annotations

import random

import pytest
import torch

import kernels.paged_attention as pa
from kernels import cbuild, cpu_attention
from kernels.cpu_attention import KernelOptions
from tests.kernels.paged_cases import TOLERANCE, reference
from tests.kernels.paged_cases import make_case as make_prefill_case

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C compiler to build the CPU kernel"
)


def make_case(
    lens, num_heads, num_kv_heads, head_dim, block_size=16, seed=0, extra_rows=0,
    dtype=torch.bfloat16,
):  # fmt: skip
    """A shuffled block pool holding each sequence's keys, NaN in every slot nobody owns."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(need)
    tables, used = [], 0
    for n, nb in zip(lens, need, strict=True):
        blocks = ids[used : used + nb]
        used += nb
        for j in range(n):  # only the slots the sequence owns hold numbers
            b, off = blocks[j // block_size], j % block_size
            k_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
        tables.append(blocks + [-1] * (width - nb))
    rows = len(lens) + extra_rows
    # q as the model slices it: the first num_heads heads of a [T, H + KVH, D] tensor
    qk = torch.randn(rows, num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
    return qk[:, :num_heads], k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def expected(q, k_cache, v_cache, tables, lens, rows, scale):
    """The slow reference for query row rows[i] of sequence i over its first lens[i] keys."""
    i32 = torch.int32
    seq_idx, ctx_len = torch.arange(len(lens), dtype=i32), torch.tensor(lens, dtype=i32)
    q = q[rows]
    return pa.paged_attention_reference(q, k_cache, v_cache, tables, seq_idx, ctx_len, scale)


def run(q, k_cache, v_cache, tables, lens, rows, scale, seq_idx=None, lib=None):
    out = torch.zeros(q.shape, dtype=q.dtype)
    i32 = torch.int32
    seq_idx = list(range(len(lens))) if seq_idx is None else seq_idx
    cpu_attention.paged_attention_cpu(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(seq_idx, dtype=i32),
        torch.tensor(rows, dtype=i32),
        torch.tensor(lens, dtype=i32),
        scale,
        out,
        lib,
    )
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 2, 32), (2, 2, 16), (8, 1, 16)],  # SmolLM2's (specialised), GQA, MHA, MQA
)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_reference_over_shuffled_blocks(
    num_heads, num_kv_heads, head_dim, block_size, dtype
):
    lens = [1, 15, 16, 17, 33, 250, 1025]
    q, kc, vc, tables = make_case(lens, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype)
    scale = head_dim**-0.5
    rows = list(range(len(lens)))
    out = run(q, kc, vc, tables, lens, rows, scale)
    want = expected(q, kc, vc, tables, lens, rows, scale)
    assert out.dtype == dtype and torch.isfinite(out).all()  # unowned NaN slots never read
    torch.testing.assert_close(out, want.to(dtype), **TOLERANCE[dtype])


def test_writes_only_the_decode_rows_and_follows_seq_idx():
    lens = [40, 7]
    q, kc, vc, tables = make_case(lens, 9, 3, 64, extra_rows=2)
    # row 3 decodes sequence 0, row 1 decodes sequence 1; rows 0 and 2 belong to others
    out = run(q, kc, vc, tables, [40, 7], [3, 1], 0.125, seq_idx=[0, 1])
    want = expected(q, kc, vc, tables, [40, 7], [3, 1], 0.125)
    torch.testing.assert_close(out[[3, 1]].float(), want.float(), **TOLERANCE[torch.bfloat16])
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch():
    lens = [300, 5, 77, 1024, 64]
    q, kc, vc, tables = make_case(lens, 9, 3, 64, seed=3)
    batch = run(q, kc, vc, tables, lens, list(range(5)), 0.125)
    for i in range(5):
        alone = run(q, kc, vc, tables, [lens[i]], [i], 0.125, seq_idx=[i])
        assert torch.equal(alone[i], batch[i])


def test_rejects_what_it_cannot_compute():
    q, kc, vc, tables = make_case([20], 9, 3, 64)
    with pytest.raises(ValueError, match="k_cache must be a float32 CPU tensor"):
        run(q.float(), kc, vc, tables, [20], [0], 0.125)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        run(q.half(), kc.half(), vc.half(), tables, [20], [0], 0.125)
    q17, kc17, vc17, t17 = make_case([20], 17, 1, 16)  # 17 query heads per KV head
    with pytest.raises(ValueError, match="at most 16 query heads per KV head"):
        run(q17, kc17, vc17, t17, [20], [0], 0.25)


def test_without_a_compiler_load_returns_none(tmp_path, caplog):
    # nothing cached: it must build, with a "compiler" that always fails
    cpu_attention.configure(KernelOptions(compiler="false", cache_root=tmp_path))
    try:
        assert cpu_attention.load() is None
        assert "could not build the CPU paged-attention kernel" in caplog.text
        cpu_attention.configure(KernelOptions(enabled=False))  # BRIGADE_CPU_KERNEL=0
        assert not cpu_attention.available()
    finally:
        cpu_attention.configure(KernelOptions())
    assert cpu_attention.available()


def test_an_unwritable_cache_falls_back_instead_of_failing(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    cpu_attention.configure(KernelOptions(cache_root=blocker))  # the cache cannot be made
    try:
        assert cpu_attention.load() is None
        assert "could not build the CPU paged-attention kernel" in caplog.text
    finally:
        cpu_attention.configure(KernelOptions())
    assert cpu_attention.available()


HERE = cpu_attention.cpu_flags()
AMD_ZEN4 = "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
LEVEL_CPUS = {  # a flags line for each level, and one (Skylake-SP) whose AVX-512 has no BF16
    "avx512bf16": AMD_ZEN4,
    "avx2": "fpu sse2 avx avx2 fma f16c bmi2",
    "none": "fpu sse2 sse4_2 avx",  # AVX without AVX2/FMA: the plain loops
}


@pytest.mark.parametrize("level", cpu_attention.ISA_LEVELS)
def test_each_level_is_chosen_from_the_cpu_flags(level):
    cpuinfo = f"processor\t: 0\nmodel name\t: test\nflags\t\t: {LEVEL_CPUS[level]}\n\n"
    assert cpu_attention.best_isa(cpu_attention.cpu_flags(cpuinfo)) == level
    skylake = frozenset("avx avx2 fma f16c avx512f avx512dq avx512bw avx512vl".split())
    assert cpu_attention.best_isa(skylake) == "avx2"
    assert cpu_attention.best_isa(frozenset(AMD_ZEN4.split()), x86=False) == "none"


def forced(level: str):
    """The library load() gives with `level` forced, or a skip where this CPU lacks it."""
    if not cpu_attention.ISA_NEEDS[level] <= HERE and cpu_attention._is_x86():
        pytest.skip(f"this CPU lacks {sorted(cpu_attention.ISA_NEEDS[level] - HERE)}")
    cpu_attention.configure(KernelOptions(isa=level))
    lib = cpu_attention.load()
    assert lib is not None
    return lib


@pytest.mark.parametrize("level", cpu_attention.ISA_LEVELS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),  # vdpbf16ps (D 64), AVX2 (D % 8 == 0), plain (D 20)
    [(9, 3, 64), (8, 2, 128), (4, 2, 32), (6, 3, 20)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_forced_level_matches_the_reference(level, num_heads, num_kv_heads, head_dim, dtype):
    try:
        lib = forced(level)
        if cpu_attention._is_x86():
            assert cpu_attention.library_isa(lib) == level  # the path it was asked for
        lens = [1, 15, 17, 300, 1025]
        q, kc, vc, tables = make_case(
            lens, num_heads, num_kv_heads, head_dim, seed=5, block_size=7, dtype=dtype
        )
        rows, scale = list(range(len(lens))), head_dim**-0.5
        out = run(q, kc, vc, tables, lens, rows, scale)
        want = expected(q, kc, vc, tables, lens, rows, scale)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want.to(dtype), **TOLERANCE[dtype])
        alone = run(q, kc, vc, tables, [lens[3]], [3], scale, seq_idx=[3])
        assert torch.equal(alone[3], out[3])  # batch invariance holds at every level
    finally:
        cpu_attention.configure(KernelOptions())


def test_a_forced_level_the_cpu_lacks_is_refused_not_run(monkeypatch, caplog):
    monkeypatch.setattr(cbuild, "cpu_flags", lambda cpuinfo=None: frozenset({"sse2"}))
    monkeypatch.setattr(cbuild, "is_x86", lambda: True)
    cpu_attention.configure(KernelOptions(isa="avx2"))
    try:
        assert cpu_attention.chosen_isa() == "avx2"
        assert cpu_attention.load() is None  # SIGILL avoided: the torch path instead
        assert "needs CPU features this CPU lacks (avx2, f16c, fma)" in caplog.text
        cpu_attention.configure(KernelOptions())
        assert cpu_attention.chosen_isa() == "none"
    finally:
        cpu_attention.configure(KernelOptions())
    with pytest.raises(ValueError, match="not one of avx512bf16, avx2, none"):
        KernelOptions(isa="amx")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_token_as_a_query_is_causal_attention_and_chunking_changes_no_bit(dtype):
    """As the engine runs bf16 and the fp32 batch-invariant mode (engine/attention.py): each
    token of a prefill, whole or in chunks, is one query over the cached keys up to its own
    position."""
    lens, bs = [23, 9], 4
    case = make_prefill_case(lens, lens, num_heads=6, num_kv_heads=2, block_size=bs, dtype=dtype)
    qs, _, _, k_cache, v_cache, tables = case
    scale = 16**-0.5

    def attend(seqs):  # [(sequence, first new token, new tokens)] of one step
        q = torch.cat([qs[i][s : s + n] for i, s, n in seqs])
        seq_idx, ctx_len = pa.token_layout(
            [n for _, _, n in seqs], [s + n for _, s, n in seqs], torch.device("cpu")
        )
        out = torch.zeros(q.shape, dtype=dtype)
        rows = torch.arange(len(q), dtype=torch.int32)
        step_tables = tables[[i for i, _, _ in seqs]].contiguous()
        cpu_attention.paged_attention_cpu(
            q, k_cache, v_cache, step_tables, seq_idx, rows, ctx_len, scale, out
        )
        return out

    whole = attend([(0, 0, 23), (1, 0, 9)])
    want = reference(case, lens, lens, scale)
    torch.testing.assert_close(whole, want.to(dtype), **TOLERANCE[dtype])
    chunks = [attend([(0, 0, 10)]), attend([(1, 0, 4), (0, 10, 12)]), attend([(0, 22, 1)])]
    assert torch.equal(torch.cat([chunks[0], chunks[1][4:], chunks[2]]), whole[:23])
    assert torch.equal(torch.cat([chunks[1][:4], attend([(1, 4, 5)])]), whole[23:])
