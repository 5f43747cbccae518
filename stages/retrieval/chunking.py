"""Documents into chunks of at most `max_tokens` tokens of the served model, pure (no I/O).

Blocks are paragraphs (split at blank lines) and Markdown heading lines; a chunk is a run of
whole blocks, cut only between blocks. A heading always starts a new chunk. A chunk after
another in the same section begins with the previous chunk's last whole paragraphs that fit in
`overlap` tokens. A paragraph longer than `max_tokens` alone is cut into token windows that
overlap by `overlap` tokens, cut at character boundaries, each a chunk by itself. Every chunk's text is exactly
`source[start:end]`, and its token count is measured on that text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_HEADING = re.compile(r"^#{1,6}[ \t]+\S.*$", re.MULTILINE)


class TextTokenizer(Protocol):
    def encode_text(self, text: str) -> list[int]: ...
    def text_offsets(self, text: str) -> list[tuple[int, int]]: ...


@dataclass(frozen=True)
class Chunk:
    text: str
    start: int  # character offsets in the document: text == document[start:end]
    end: int
    num_tokens: int


@dataclass(frozen=True)
class Block:
    start: int
    end: int
    heading: bool = False
    window: bool = False  # a token window of a paragraph longer than a chunk


def blocks(text: str) -> list[Block]:
    """Paragraphs and heading lines, as spans without their surrounding whitespace."""
    found: list[Block] = []
    pos = 0
    for piece_end, next_start in [(m.start(), m.end()) for m in _BLANK_LINES.finditer(text)] + [
        (len(text), len(text))
    ]:
        cursor = pos
        for h in _HEADING.finditer(text, pos, piece_end):
            found += _span(text, cursor, h.start())
            found += _span(text, h.start(), h.end(), heading=True)
            cursor = h.end()
        found += _span(text, cursor, piece_end)
        pos = next_start
    return found


def _span(text: str, start: int, end: int, heading: bool = False) -> list[Block]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return [Block(start, end, heading)] if end > start else []


def windows(
    text: str, block: Block, tok: TextTokenizer, max_tokens: int, overlap: int
) -> list[Block]:
    """Token windows of one long block, each <= max_tokens, consecutive ones sharing ~overlap."""
    piece = text[block.start : block.end]
    offsets = tok.text_offsets(piece)
    # a window starts or ends only where a token starts a new character
    cuts = [i for i, (s, _) in enumerate(offsets) if i == 0 or s != offsets[i - 1][0]]
    cuts.append(len(offsets))
    char_at = {i: (offsets[i][0] if i < len(offsets) else len(piece)) for i in cuts}
    found: list[Block] = []
    a = 0
    while True:
        e = max(c for c in cuts if c <= a + max_tokens and c > a)
        while e > a and len(tok.encode_text(piece[char_at[a] : char_at[e]])) > max_tokens:
            e = max(c for c in cuts if c < e)
        assert e > a, f"no window of <= {max_tokens} tokens starts at token {a}"
        found.append(Block(block.start + char_at[a], block.start + char_at[e], window=True))
        if e == len(offsets):
            return found
        a = min(c for c in cuts if c >= max(e - overlap, a + 1))


def chunk_text(text: str, tok: TextTokenizer, *, max_tokens: int, overlap: int) -> list[Chunk]:
    if max_tokens < 1 or not 0 <= overlap < max_tokens:
        raise ValueError(f"chunking needs max_tokens >= 1 and 0 <= overlap < max_tokens, got {max_tokens}, {overlap}")  # fmt: skip

    def count(first: Block, last: Block) -> int:
        return len(tok.encode_text(text[first.start : last.end]))

    units: list[Block] = []
    for b in blocks(text):
        if count(b, b) <= max_tokens:
            units.append(b)
        else:
            units += windows(text, b, tok, max_tokens, overlap)
    chunks: list[Chunk] = []
    current: list[Block] = []

    def close() -> None:
        first, last = current[0], current[-1]
        chunks.append(
            Chunk(text[first.start : last.end], first.start, last.end, count(first, last))
        )

    for u in units:
        starts_section = u.heading and not all(b.heading for b in current)  # headings stay together
        alone = u.window or (current and current[-1].window)  # a window is a chunk by itself
        if current and (starts_section or alone or count(current[0], u) > max_tokens):
            close()
            tail: list[Block] = []
            if not u.heading and not u.window:
                for prev in reversed(current):
                    if prev.window or prev.heading or count(prev, current[-1]) > overlap:
                        break
                    tail.insert(0, prev)
            current = tail
            while current and count(current[0], u) > max_tokens:
                current.pop(0)
        current.append(u)
    if current:
        close()
    return chunks
