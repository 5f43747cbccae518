"""Bounded JSON decoding: every decoder of client or bus input goes through `decode_bounded`,
which refuses JSON nested deeper than `max_depth` or larger than `max_bytes` before msgspec reads
it (msgspec recurses, and raises RecursionError near Python's stack limit: an HTTP 500).

The refusal is a `JsonBoundsError`, a msgspec.ValidationError that names the path (`- at
`$.guided_json.a``) and carries it as `field`, so every existing handler of bad input serves it.
"""

from __future__ import annotations

import re
from itertools import accumulate, count
from operator import sub
from typing import Any

import msgspec

MAX_JSON_DEPTH = 64  # containers nested in one message, events and submits alike
MAX_VALUE_DEPTH = 32  # a free-form value inside a submit (a JSON schema), so events fit the above
MAX_JSON_BYTES = 64 << 20  # above every configured body, frame and NATS payload limit
_PATH_PARTS = 6  # a refusal names the path to this many levels

# a JSON string (escapes included), then `:` if it is an object key; or a bracket
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{}]', re.DOTALL)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # an opening +1, a closing -1 (after -1)
_OPEN, _CLOSE, _LIST, _QUOTE = frozenset(b"[{"), frozenset(b"]}"), ord("["), ord('"')
_any = msgspec.json.Decoder()


class JsonBoundsError(msgspec.ValidationError):
    """JSON over a bound. `field` is the path to the too-deep value (None: the whole input)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        at = "" if not field else f" - at `${field}`" if field[0] == "[" else f" - at `$.{field}`"
        super().__init__(message + at)
        self.field = field


def json_depth(data: bytes) -> int:
    """The deepest nesting of containers outside strings (`{"a": [1]}` is 2), at C speed."""
    steps = _STRING.sub(b"", data).translate(_STEP, _NOT_BRACKET)
    return max(map(sub, accumulate(steps), count(1)), default=0)


def check_bounds(
    data: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES
) -> None:
    """Raise JsonBoundsError if `data` is larger than max_bytes or nested deeper than max_depth."""
    if len(data) > max_bytes:
        raise JsonBoundsError(f"the JSON is {len(data)} bytes; at most {max_bytes} are read")
    if data.count(b"[") + data.count(b"{") <= max_depth:  # cannot be deeper: the usual case
        return
    if json_depth(data) <= max_depth:
        return
    _, path, _ = _first_deep(data, max_depth)
    raise JsonBoundsError(
        f"JSON nested deeper than {max_depth} levels is refused", _render(path) or None
    )


def decode_bounded(
    decoder: msgspec.json.Decoder | None,
    data: bytes | str,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    max_bytes: int = MAX_JSON_BYTES,
) -> Any:
    """`decoder.decode(data)` (None: untyped) once `data` is within bounds; JsonBoundsError or
    msgspec's own DecodeError / ValidationError otherwise."""
    raw = data.encode() if isinstance(data, str) else data
    check_bounds(raw, max_depth=max_depth, max_bytes=max_bytes)
    return (decoder or _any).decode(raw)


def without_deep_values(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> bytes:
    """`data` cut where its first too-deep value opens, that value null and its containers
    closed: enough to read the envelope (request_id, tenant) of input that `check_bounds`
    refuses, when the envelope comes before the deep value. Costs the path, not the input."""
    if data.count(b"[") + data.count(b"{") <= max_depth or json_depth(data) <= max_depth:
        return data
    start, _, kinds = _first_deep(data, max_depth)
    closing = b"".join(b"]" if c == _LIST else b"}" for c in reversed(kinds))
    return data[:start] + b"null" + closing


def value_depth(value: Any) -> int:
    """The nesting of a decoded JSON value (a dict or list of them), as json_depth counts it."""
    return json_depth(msgspec.json.encode(value))


def _first_deep(data: bytes, max_depth: int) -> tuple[int, list[str | int], list[int]]:
    """(offset, path, open brackets) of the first container that opens at depth max_depth + 1.

    Walks strings and brackets only, and stops there; the commas between two such tokens are
    the innermost container's, so they give a list's index without visiting every element."""
    kinds: list[int] = []  # the open containers' brackets
    path: list[str | int] = []  # per open container: the key or index of the current child
    prev = 0
    for m in _TOKEN.finditer(data):
        c = data[m.start()]
        if kinds and kinds[-1] == _LIST:
            path[-1] += data.count(b",", prev, m.start())  # type: ignore[operator]
        prev = m.end()
        if c == _QUOTE:
            if m.group(1) and kinds and kinds[-1] != _LIST:
                path[-1] = _key(data[m.start() : m.start(1)])
        elif c in _OPEN:
            if len(kinds) == max_depth:
                return m.start(), path, kinds
            kinds.append(c)
            path.append(0 if c == _LIST else "")
        elif kinds:  # a closing one; an unmatched one is msgspec's to report
            kinds.pop()
            path.pop()
    raise AssertionError("_first_deep is called only on input deeper than max_depth")


def _key(quoted: bytes) -> str:
    try:
        return str(msgspec.json.decode(quoted))
    except msgspec.DecodeError:
        return quoted.decode(errors="replace").strip('"')


def _render(path: list[str | int]) -> str:
    text = ""
    for part in path[:_PATH_PARTS]:
        if part == "":  # an object whose first key is not read yet
            break
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text
