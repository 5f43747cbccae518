"""Writes a tiny random Llama as a Hugging Face directory (config, safetensors, tokenizer).

Small enough that an engine built on it runs a whole batch test in a second, real enough that
it goes through the same loader, paged attention and sampler as SmolLM2. GQA: 4 query heads
share 2 KV heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # eos = 2
WORDS = ["user", "assistant", "system"] + [f"w{i}" for i in range(253)]
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": len(SPECIALS) + len(WORDS),  # 259
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def write_weights(path: Path, config: dict, seed: int = 0) -> None:
    """Random weights of `config`'s shape (model.safetensors) and config.json, seeded."""
    path.mkdir(parents=True, exist_ok=True)
    c = config
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {
        "model.embed_tokens.weight": w(vocab, h, std=1.0),
        "model.norm.weight": 1.0 + w(h, std=0.1),
        "lm_head.weight": w(vocab, h, std=0.3),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q_out, h),
            p + "self_attn.k_proj.weight": w(kv_out, h),
            p + "self_attn.v_proj.weight": w(kv_out, h),
            p + "self_attn.o_proj.weight": w(h, q_out),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": 1.0 + w(h, std=0.1),
            p + "post_attention_layernorm.weight": 1.0 + w(h, std=0.1),
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c, indent=1))


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    write_weights(path, CONFIG, seed)

    vocab_map = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
        )
    )
    return path


def write_tiny_llama_with_tokenizer(path: Path, tokenizer_of: str, seed: int = 0) -> Path:
    """The tiny random Llama with another model's tokenizer and chat template (`tokenizer_of`:
    a registered name, .gguf or HF dir): a second model that shares the first's ids, so only
    the weights answer differently."""
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_of)
    config = {**CONFIG, "vocab_size": tok.vocab_size, "max_position_embeddings": 2048}
    write_weights(path, {**config, "eos_token_id": tok.eos_token_id}, seed)
    tok._backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "chat_template": tok.chat_template,
            }
        )
    )
    return path
