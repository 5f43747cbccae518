"""The embedder equals transformers' BertModel + mean pooling + L2 norm on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.embedding import EMBEDDING_DIM, Embedder, model_dir

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Anne Elliot had been forced into prudence in her youth.",
    "NATS JetStream stores every event of a request in one stream.",
    "short",
    "A much longer sentence about paged attention, KV cache blocks, continuous batching and "
    "chunked prefill, written so that its padding differs from the others in the batch.",
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def reference(texts: list[str]) -> np.ndarray:
    transformers = pytest.importorskip("transformers")
    path = model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    pooled = (hidden * m).sum(1) / m.sum(1)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()


def test_embeddings_match_transformers_bert_with_mean_pooling(embedder: Embedder) -> None:
    ours = embedder.embed(SENTENCES, batch_size=2)  # batches of mixed padding
    ref = reference(SENTENCES)
    assert ours.shape == (len(SENTENCES), EMBEDDING_DIM) and ours.dtype == np.float32
    cosine = (ours * ref).sum(1)
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_a_text_embeds_the_same_alone_and_in_a_batch(embedder: Embedder) -> None:
    alone = embedder.embed([SENTENCES[1]])
    batched = embedder.embed(SENTENCES)[1:2]
    np.testing.assert_allclose(alone, batched, atol=1e-5)


def test_similar_sentences_are_closer_than_unrelated_ones(embedder: Embedder) -> None:
    a, b, c = embedder.embed(
        [
            "How do I reset my password?",
            "Steps to change a forgotten password",
            "Tomato soup recipe",
        ]
    )
    assert a @ b > a @ c + 0.3


def test_long_text_is_cut_at_max_seq_len_and_nothing_is_empty(embedder: Embedder) -> None:
    long = " ".join(["word"] * 2000)
    out = embedder.embed([long, ""])
    assert np.isfinite(out).all() and out.shape == (2, EMBEDDING_DIM)
    assert embedder.embed([]).shape == (0, EMBEDDING_DIM)
