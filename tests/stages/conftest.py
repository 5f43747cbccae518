"""Shared by the stage tests: the served model's tokenizer and the real MiniLM embedder, once per
session (retrieval, ingest)."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def embed():
    from engine.embedding import Embedder

    return Embedder().embed
