"""ModelConfig from GGUF metadata and HF config.json, and its validation."""

import os

import pytest

from engine.config import ModelConfig

HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GGUF = {
    "general.architecture": "llama",
    "llama.block_count": 30,
    "llama.context_length": 8192,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.rope.freq_base": 100000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 49152,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}


def test_gguf_and_hf_describe_the_same_model():
    from_hf = ModelConfig.from_hf_config(HF)
    from_gguf = ModelConfig.from_gguf_metadata(GGUF, has_output_weight=False)
    assert from_hf == from_gguf
    assert (from_hf.head_dim, from_hf.num_queries_per_kv) == (64, 3)
    assert not ModelConfig.from_gguf_metadata(GGUF, has_output_weight=True).tie_word_embeddings


def test_hf_variants():
    nested = {k: v for k, v in HF.items() if k != "rope_theta"}
    nested["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert ModelConfig.from_hf_config(nested).rope_theta == 500000.0
    assert ModelConfig.from_hf_config({**HF, "eos_token_id": [7, 2]}).eos_token_id == 7
    assert ModelConfig.from_hf_config({**HF, "head_dim": 32}).head_dim == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 4}, r"num_heads \(9\) must be a multiple of num_kv_heads \(4\)"),
        ({"num_hidden_layers": 0}, r"ModelConfig.num_layers must be > 0, got 0"),
        ({"model_type": "mistral", "architectures": ["X"]}, "only Llama models are supported"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling .* is not supported"),
        ({"eos_token_id": None}, "config.json has no eos_token_id"),
    ],
)
def test_hf_errors_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**HF, **change})


def test_gguf_errors_name_the_problem():
    with pytest.raises(ValueError, match="GGUF architecture 'qwen2' is not supported"):
        ModelConfig.from_gguf_metadata(
            {**GGUF, "general.architecture": "qwen2"}, has_output_weight=False
        )
    missing = {k: v for k, v in GGUF.items() if k != "llama.block_count"}
    with pytest.raises(ValueError, match="GGUF metadata lacks 'llama.block_count'"):
        ModelConfig.from_gguf_metadata(missing, has_output_weight=False)


def test_openmp_spins_a_bounded_while_unless_told_otherwise():
    """engine/__init__ sets the documented spin count before torch loads; a user's wait policy
    or spin count stands."""
    import subprocess
    import sys

    from schemas import settings

    code = "import os, engine, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def spin(**extra: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env | extra, capture_output=True, text=True
        )
        return out.stdout.strip()

    assert spin() == str(settings.GOMP_SPINCOUNT.default) == "100000"
    assert spin(GOMP_SPINCOUNT="5") == "5"
    assert spin(OMP_WAIT_POLICY="PASSIVE") == "None"
