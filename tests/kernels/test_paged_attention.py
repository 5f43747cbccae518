"""Paged attention: the slow reference against dense causal attention, the Triton kernel (under
TRITON_INTERPRET=1, tiny shapes) against the reference, per-dtype tolerances."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.paged_attention as pa
from tests.kernels.paged_cases import TOLERANCE, make_case, reference


def dense_causal(q, k, v):
    """Naive attention for one sequence: q [ql, H, D] are the last ql of k/v [sl, KVH, D]."""
    ql, num_heads, head_dim = q.shape
    sl, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    k = k.double().repeat_interleave(rep, dim=1)  # [sl, H, D]
    v = v.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(head_dim)
    q_pos = torch.arange(sl - ql, sl)[:, None]
    scores = scores.masked_fill(torch.arange(sl)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "heads", "block_size"),
    [
        ([1, 1, 1], [1, 15, 17], (4, 4), 4),  # decodes; a 1-token fresh sequence
        ([15, 1, 17], [15, 33, 40], (6, 2), 8),  # fresh prefill, decode, chunk over context
        ([5], [5], (9, 3), 16),  # SmolLM2's 3:1 GQA, one partial block
        ([3, 1], [20, 1025], (8, 1), 16),  # multi-query, a long context
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_dense_causal_attention(query_lens, seq_lens, heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    case = make_case(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
    )
    qs, keys, values = case[:3]
    out = reference(case, query_lens, seq_lens, 16**-0.5)
    expected = torch.cat([dense_causal(q, k, v) for q, k, v in zip(qs, keys, values, strict=True)])
    assert out.shape == expected.shape and out.dtype == dtype
    # both in float64: they differ by the rounding of the result to the case's dtype, no more
    rtol = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=rtol)


KERNEL_CASES = [  # (query_lens, seq_lens, (heads, kv heads), block_size, dtype)
    ([1, 1], [15, 17], (4, 2), 8, torch.float32),  # decode across a block boundary
    ([2, 1], [2, 1], (3, 3), 4, torch.float32),  # fresh prefill; a sequence of length 1
    ([3, 1], [17, 9], (9, 3), 16, torch.bfloat16),  # chunk on a cached prefix, GQA 3:1
    ([1], [12], (4, 1), 6, torch.float16),  # block size not a power of two
]


def check_kernel_cases() -> None:
    """Run in a child with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    for query_lens, seq_lens, (num_heads, num_kv_heads), block_size, dtype in KERNEL_CASES:
        case = make_case(
            query_lens,
            seq_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            dtype=dtype,
            seed=1,
        )
        qs, _, _, k_cache, v_cache, block_tables = case
        seq_idx, ctx_len = pa.token_layout(query_lens, seq_lens, torch.device("cpu"))
        q = torch.cat(qs)
        out = pa.paged_attention(q, k_cache, v_cache, block_tables, seq_idx, ctx_len, 0.25)
        expected = reference(case, query_lens, seq_lens, 0.25)
        assert out.dtype == dtype, (out.dtype, dtype)
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
        print("ok", query_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype)
    k_cache = torch.zeros(4, 8, 2, 16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    seq_idx, ctx_len = pa.token_layout([1], [5], torch.device("cpu"))
    bad = [
        ("dtype mismatch", torch.zeros(1, 4, 16, dtype=torch.bfloat16), tables),
        ("not a multiple", torch.zeros(1, 3, 16), tables),
        ("int32", torch.zeros(1, 4, 16), tables.long()),
    ]
    for message, q, t in bad:
        try:
            pa.paged_attention(q, k_cache, k_cache, t, seq_idx, ctx_len, 0.25)
        except ValueError as e:
            assert message in str(e), (message, str(e))
        else:
            raise AssertionError(f"no ValueError for {message}")
    print("ok wrapper checks")


def test_triton_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton", reason="triton is not installed")
    root = Path(__file__).parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    code = "from tests.kernels.test_paged_attention import check_kernel_cases as c; c()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == len(KERNEL_CASES) + 1


def test_token_layout_gives_each_token_its_sequence_and_causal_context():
    seq_idx, ctx_len = pa.token_layout([3, 1, 2], [3, 20, 7], torch.device("cpu"))
    assert seq_idx.tolist() == [0, 0, 0, 1, 2, 2] and seq_idx.dtype == torch.int32
    assert ctx_len.tolist() == [1, 2, 3, 20, 6, 7] and ctx_len.dtype == torch.int32
