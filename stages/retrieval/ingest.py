"""Adding one document to a collection: parse (text, Markdown, JSON lines), chunk, embed,
store. Re-adding the same content is a no-op found by its hash before anything is embedded.

A JSON lines file is a document per record: its `text` (or `content`) field, its source the
file's name and the record's `id` (or line number).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from stages.retrieval.chunking import TextTokenizer, chunk_text
from stages.retrieval.store import DocumentInfo, NewChunk, Store, content_hash

Format = Literal["text", "markdown", "jsonl"]
Embed = Callable[[list[str]], np.ndarray]  # texts -> unit vectors [n, 384]
FORMATS: dict[str, Format] = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
}


@dataclass(frozen=True, kw_only=True)
class Chunking:
    max_tokens: int
    overlap: int

    def __post_init__(self) -> None:
        if not 0 <= self.overlap < self.max_tokens:
            raise ValueError(
                f"a chunk's overlap ({self.overlap} tokens, BRIGADE_CHUNK_OVERLAP) must be below "
                f"its size ({self.max_tokens}, BRIGADE_CHUNK_TOKENS)"
            )


@dataclass(frozen=True, kw_only=True)
class SourceText:
    source: str
    text: str


def format_of(path: Path) -> Format:
    found = FORMATS.get(path.suffix.lower())
    if found is None:
        raise ValueError(
            f"{path.name}: unknown document format {path.suffix!r}; give one of "
            f"{', '.join(sorted(FORMATS))} (text, Markdown or JSON lines)"
        )
    return found


def parse(source: str, data: str, fmt: Format) -> Iterator[SourceText]:
    if fmt in ("text", "markdown"):
        yield SourceText(source=source, text=data)
        return
    for line_no, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}:{line_no}: not JSON ({err.msg})") from None
        text = record.get("text", record.get("content")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{source}:{line_no}: a record needs a string `text` or `content`")
        name = record.get("id", line_no)
        yield SourceText(source=f"{source}#{name}", text=text)


def add_text(
    store: Store,
    embed: Embed,
    tok: TextTokenizer,
    chunking: Chunking,
    *,
    tenant: str,
    collection: str,
    source: str,
    text: str,
) -> tuple[DocumentInfo, bool]:
    """The stored document, and whether it was added now (False: the same text was there)."""
    digest = content_hash(text)
    found = store.find_document(tenant, collection, digest)
    if found is not None:
        return found, False
    chunks = chunk_text(text, tok, max_tokens=chunking.max_tokens, overlap=chunking.overlap)
    vectors = embed([c.text for c in chunks]) if chunks else np.zeros((0, 384), np.float32)
    return store.add_document(
        tenant,
        collection,
        source=source,
        digest=digest,
        num_chars=len(text),
        chunks=[
            NewChunk(text=c.text, start=c.start, end=c.end, num_tokens=c.num_tokens) for c in chunks
        ],
        vectors=vectors,
    )
