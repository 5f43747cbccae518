"""The compiled causal prefill attention against float64 SDPA, at each level this CPU has, over
awkward lengths, GQA ratios and head sizes, on q/k/v strided as the model slices them from its
fused qkv; and the plan that routes fp32 chunks with nothing cached to it.

Tolerance (fp32 sums in another order than SDPA's): atol 1e-5, rtol 1e-5 against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_causal_attention as ca
from kernels import cpu_sdpa_attention as sdpa
from kernels.cbuild import cpu_flags, is_x86

pytestmark = pytest.mark.skipif(not ca.available(), reason="no C compiler to build the kernel")


def reference(q, k, v, scale):
    """float64 SDPA, causal, GQA: [T, H, D] -> [T, H, D]."""
    out = F.scaled_dot_product_attention(
        *(x.double().transpose(0, 1)[None] for x in (q, k, v)),
        is_causal=True, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


def fused_qkv(t, h, kvh, d, seed):
    """q, k, v as views of one [T, (H + 2 KVH) * D] tensor, as the model slices them."""
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=torch.Generator().manual_seed(seed))
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    return q, k, v


@pytest.fixture(params=["avx512", "none"])
def level(request):
    if request.param == "avx512" and is_x86() and not ca.LEVELS.needs["avx512"] <= cpu_flags():
        pytest.skip("this CPU lacks AVX-512")
    ca.configure(ca.CausalOptions(isa=request.param))
    try:
        lib = ca.load()
        assert lib is not None and (not is_x86() or ca.library_isa(lib) == request.param)
        yield request.param
    finally:
        ca.configure(ca.CausalOptions())


@pytest.mark.parametrize("t", [1, 15, 16, 17, 33, 100, 512])
@pytest.mark.parametrize(("h", "kvh", "d"), [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_matches_float64_sdpa(level, t, h, kvh, d):
    q, k, v = fused_qkv(t, h, kvh, d, seed=t + h)
    got = ca.causal_attention(q, k, v, d**-0.5)
    assert got.shape == (t, h, d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(q, k, v, d**-0.5), atol=1e-5, rtol=1e-5)


def test_each_token_sees_only_itself_and_earlier_ones():
    q, k, v = fused_qkv(40, 9, 3, 64, seed=1)
    base = ca.causal_attention(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[30:] += 5.0  # later keys and values changed: rows 0..29 keep their output
    v2[30:] -= 3.0
    changed = ca.causal_attention(q, k2, v2, 0.125)
    torch.testing.assert_close(changed[:30], base[:30], atol=1e-6, rtol=0)
    assert (changed[30:] - base[30:]).abs().max() > 0.1


def test_writes_into_the_rows_it_is_given():
    q, k, v = fused_qkv(20, 9, 3, 64, seed=3)
    whole = torch.full((30, 9, 64), 7.0)
    got = ca.causal_attention(q, k, v, 0.125, out=whole[5:25])
    assert got.data_ptr() == whole[5:25].data_ptr()
    assert torch.equal(whole[5:25], ca.causal_attention(q, k, v, 0.125))
    assert (whole[:5] == 7.0).all() and (whole[25:] == 7.0).all()
    with pytest.raises(ValueError, match="out must be"):
        ca.causal_attention(q, k, v, 0.125, out=torch.empty(20, 64, 9).transpose(1, 2))


def test_refuses_what_it_does_not_take():
    q, k, v = fused_qkv(8, 9, 3, 64, seed=2)
    with pytest.raises(ValueError, match="float32"):
        ca.causal_attention(q.double(), k, v, 0.125)
    with pytest.raises(ValueError, match="query heads"):
        ca.causal_attention(torch.randn(8, 18, 64), torch.randn(8, 2, 64)[:, :1].contiguous(),
                            torch.randn(8, 1, 64), 0.125)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        ca.causal_attention(q.transpose(1, 2), k, v, 0.125)


def test_the_plan_routes_fp32_chunks_with_nothing_cached_to_the_kernel():
    """A step with a fresh prompt (causal kernel) and a chunk over cached blocks (SDPA): both
    match the SDPA plan's answers within fp32 tolerance."""
    block_size, num_blocks = 16, 12
    tables = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]], dtype=torch.int32)
    query_lens, seq_lens = [40, 20], [40, 60]  # the second: 40 cached, 20 new
    q, k, v = fused_qkv(60, 9, 3, 64, seed=3)
    k_cache = torch.randn(num_blocks, block_size, 3, 64)
    v_cache = torch.randn(num_blocks, block_size, 3, 64)
    slots = torch.cat([torch.arange(40), 3 * block_size + 40 + torch.arange(20)])
    k_cache.view(-1, 3, 64)[slots] = k
    v_cache.view(-1, 3, 64)[slots] = v
    plain = sdpa.build_sdpa_plan(tables, query_lens, seq_lens, block_size)
    routed = sdpa.build_sdpa_plan(tables, query_lens, seq_lens, block_size, causal_kernel=True)
    assert routed.causal_kernel and not plain.causal_kernel
    want = sdpa.paged_attention_sdpa(q, k, v, k_cache, v_cache, plain, 0.125)
    got = sdpa.paged_attention_sdpa(q, k, v, k_cache, v_cache, routed, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[40:], want[40:])  # the chunk over cached blocks stays on SDPA
    assert not torch.equal(got[:40], want[:40])  # the fresh prompt took the kernel's sums
