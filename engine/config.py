"""ModelConfig: the shape of a Llama-family model, read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, has_output_weight: bool) -> ModelConfig:
        """`has_output_weight`: the file has its own LM head (`output.weight`), else it is tied."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' is")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks '{arch}.{key}'")
            return value

        hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta["tokenizer.ggml.tokens"])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("rope.dimension_count", hidden // num_heads)),
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings=not has_output_weight,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]),
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type")]
        if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
            raise ValueError(f"config.json describes {archs}; only Llama models are supported")
        if cfg.get("rope_scaling"):
            raise ValueError(f"rope_scaling {cfg['rope_scaling']} is not supported")
        num_heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        if eos is None:
            raise ValueError("config.json has no eos_token_id")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # newer transformers nest it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=int(eos),
        )
