"""The embedder in fp32 equals transformers' BertModel + mean pooling + L2 norm on the same
weights; the default (bf16 products) stays within cosine 0.9999 of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.embedding import EMBEDDING_DIM, Embedder, model_dir
from tools.bench.rag import questions as rag_questions

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
    return Embedder()  # the default: bf16 products


@pytest.fixture(scope="module")
def fp32() -> Embedder:
    return Embedder(precision="fp32")


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


def test_fp32_embeddings_match_transformers_bert_with_mean_pooling(fp32: Embedder) -> None:
    ours = fp32.embed(SENTENCES, batch_size=2)  # batches of mixed padding
    ref = reference(SENTENCES)
    assert ours.shape == (len(SENTENCES), EMBEDDING_DIM) and ours.dtype == np.float32
    cosine = (ours * ref).sum(1)
    assert cosine.min() >= 0.999999, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_bf16_products_stay_within_cosine_0_9999_of_fp32(embedder: Embedder, fp32) -> None:
    texts = [*SENTENCES, *(q["question"] for q in rag_questions()[:20])]
    ours, ref = embedder.embed(texts, batch_size=4), fp32.embed(texts)
    assert ours.dtype == np.float32
    cosine = (ours * ref).sum(1)
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    assert not np.array_equal(ours, ref)  # the products did run in bf16


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        Embedder(precision="int8")


def test_a_text_embeds_the_same_alone_and_in_a_batch(embedder: Embedder, fp32) -> None:
    alone = fp32.embed([SENTENCES[1]])
    batched = fp32.embed(SENTENCES)[1:2]
    np.testing.assert_allclose(alone, batched, atol=1e-5)
    # bf16 rounds each product's output, and the GEMM's blocking follows the batch's rows
    alone, batched = embedder.embed([SENTENCES[1]]), embedder.embed(SENTENCES)[1:2]
    assert float(alone[0] @ batched[0]) >= 0.99999


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


def test_a_query_embeds_on_one_thread_and_the_thread_count_is_put_back(embedder) -> None:
    threads = torch.get_num_threads()
    seen: list[int] = []
    forward = embedder.encoder.forward

    def spy(ids, mask):
        seen.append(torch.get_num_threads())
        return forward(ids, mask)

    embedder.encoder.forward = spy
    try:
        embedder.embed(["Who persuaded Anne?"])  # 7 tokens: one thread
        embedder.embed(["word " * 200, "word " * 200])  # over SINGLE_THREAD_TOKENS: all threads
    finally:
        del embedder.encoder.forward
    assert seen == [1, threads] and torch.get_num_threads() == threads
