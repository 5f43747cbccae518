import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache, estimate_kv_bytes, num_blocks_for_budget

SMOLLM2 = ModelConfig(
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=259,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def test_estimate_formula_is_gqa_aware():
    # 2 x 30 layers x 4 seqs x 3 kv heads x 8192 tokens x 64 x 2 bytes
    assert estimate_kv_bytes(SMOLLM2, num_tokens=8192, batch_size=4, dtype=torch.bfloat16) == (
        754_974_720
    )
    assert estimate_kv_bytes(SMOLLM2, num_tokens=1, dtype=torch.float32) == 46_080


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_equals_what_the_cache_allocates(dtype):
    cache = KVCache(TINY, num_blocks=10, block_size=16, dtype=dtype)
    assert len(cache.kv_caches) == 2
    k, v = cache.kv_caches[0]
    assert k.shape == v.shape == (10, 16, 2, 16) and k.dtype == dtype
    assert float(k.abs().sum()) == 0.0
    assert cache.nbytes == estimate_kv_bytes(TINY, num_tokens=160, dtype=dtype)
    assert cache.nbytes == 2 * 2 * 2 * 160 * 16 * dtype.itemsize


def test_blocks_from_budget():
    per_block = estimate_kv_bytes(SMOLLM2, num_tokens=16, dtype=torch.bfloat16)  # 368,640
    assert (
        num_blocks_for_budget(
            SMOLLM2, block_size=16, dtype=torch.bfloat16, budget_bytes=10 * per_block + 5
        )
        == 10
    )
    cache = KVCache(
        TINY,
        num_blocks=num_blocks_for_budget(
            TINY, block_size=4, dtype=torch.float32, budget_bytes=100_000
        ),
        block_size=4,
        dtype=torch.float32,
    )
    assert cache.num_blocks == 48 and cache.nbytes == 98_304  # 2,048 bytes per block
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000 holds no block of 16 tokens"):
        num_blocks_for_budget(SMOLLM2, block_size=16, dtype=torch.float32, budget_bytes=1000)
