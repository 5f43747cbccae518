"""Chunking: whole paragraphs, headings start chunks, overlap by whole paragraphs, long
paragraphs in token windows; every chunk is its document's exact slice and within max_tokens."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from stages.retrieval.chunking import Block, blocks, chunk_text


def n(tok: Tokenizer, text: str) -> int:
    return len(tok.encode_text(text))


def test_blocks_are_paragraphs_and_heading_lines_without_their_whitespace() -> None:
    text = "# Title\nIntro line one.\nIntro line two.\n\n  \n\nSecond para.\n## Sub\n\nThird."
    found = blocks(text)
    assert [text[b.start : b.end] for b in found] == [
        "# Title",
        "Intro line one.\nIntro line two.",
        "Second para.",
        "## Sub",
        "Third.",
    ]
    assert [b.heading for b in found] == [True, False, False, True, False]
    assert blocks("") == [] and blocks("\n\n  \n") == []


def test_paragraphs_pack_whole_and_cut_only_between_them(tok: Tokenizer) -> None:
    paras = [f"Paragraph {i} says " + "word " * 20 + "end." for i in range(6)]
    text = "\n\n".join(paras)
    per = n(tok, paras[0])
    two = n(tok, paras[0] + "\n\n" + paras[1])
    assert two < 2 * per + 3 < 3 * per
    chunks = chunk_text(text, tok, max_tokens=two, overlap=0)
    assert [c.text for c in chunks] == [
        paras[0] + "\n\n" + paras[1],
        paras[2] + "\n\n" + paras[3],
        paras[4] + "\n\n" + paras[5],
    ]
    starts = [text.index(p) for p in paras]
    assert [(c.start, c.end) for c in chunks] == [
        (starts[0], starts[1] + len(paras[1])),
        (starts[2], starts[3] + len(paras[3])),
        (starts[4], len(text)),
    ]
    for c in chunks:
        assert c.text == text[c.start : c.end] and c.num_tokens == n(tok, c.text) <= two


def test_overlap_repeats_the_last_whole_paragraph_that_fits(tok: Tokenizer) -> None:
    short = [f"Short {i}." for i in range(4)]
    text = "\n\n".join(short)
    max_tokens = n(tok, short[0] + "\n\n" + short[1])
    chunks = chunk_text(text, tok, max_tokens=max_tokens, overlap=n(tok, short[1]))
    assert [c.text for c in chunks] == [
        "Short 0.\n\nShort 1.",
        "Short 1.\n\nShort 2.",
        "Short 2.\n\nShort 3.",
    ]


def test_a_heading_starts_a_chunk_and_consecutive_headings_stay_together(tok: Tokenizer) -> None:
    text = "# Book\n## Chapter one\nIt begins.\n\nIt goes on.\n\n## Chapter two\nIt ends."
    chunks = chunk_text(text, tok, max_tokens=200, overlap=50)
    assert [c.text for c in chunks] == [
        "# Book\n## Chapter one\nIt begins.\n\nIt goes on.",
        "## Chapter two\nIt ends.",
    ]


def test_a_long_paragraph_is_cut_into_overlapping_token_windows(tok: Tokenizer) -> None:
    long = " ".join(f"w{i}" for i in range(300))
    text = "Before.\n\n" + long + "\n\nAfter."
    chunks = chunk_text(text, tok, max_tokens=64, overlap=16)
    assert chunks[0].text == "Before." and chunks[-1].text == "After."
    middle = chunks[1:-1]
    assert len(middle) >= 300 * 2 // 64
    assert middle[0].start == text.index(long) and middle[-1].end == text.index(long) + len(long)
    for a, b in zip(middle, middle[1:], strict=False):
        assert b.start < a.end  # windows overlap
        shared = n(tok, text[b.start : a.end])
        assert 14 <= shared <= 18, shared
    for c in chunks:
        assert c.text == text[c.start : c.end] and c.num_tokens <= 64


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    text = "日本語のテキスト。" * 60
    chunks = chunk_text(text, tok, max_tokens=32, overlap=4)
    assert len(chunks) > 2
    for c in chunks:
        assert c.text == text[c.start : c.end] and "\ufffd" not in c.text and c.num_tokens <= 32


def test_bad_sizes_are_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="overlap"):
        chunk_text("x", tok, max_tokens=8, overlap=8)
    assert Block(0, 1).window is False
