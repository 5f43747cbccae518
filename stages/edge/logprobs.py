"""Per-token logprobs in OpenAI's shapes, from the engine's `tokens` events.

`text` events carry no token ids, so a run that asks for logprobs keeps its `tokens` events as
its watch sees them (the same subscription; a missed one is read back from the log). Text delta
`seq` s comes from tokens event s; the final flush (after the last tokens event) has none.
Chat: `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`; completions (legacy):
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`. The sampled special
tokens (the end of sequence) are left out, as they are from the text; tokens after a stop string
ended the text are left out too. With echo (completions), the prompt's tokens come first: the
first with a null logprob and no alternatives, each later one with its logprob and top-n.
"""

from __future__ import annotations

import codecs
import functools
from typing import Any

import anyio
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from engine.tokenizer import Tokenizer
from schemas import subjects
from schemas.events import AnyEvent, RunFinished, TokenLogprob, TokensGenerated, decode_event


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a BPE vocabulary writes per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token id -> (text, UTF-8 bytes). A byte-level token's bytes are exact even when it holds
    part of a character (its text then shows U+FFFD); an added token's are its text's."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = tokenizer.special_token_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.id_to_token(token_id)
        table = _unicode_to_byte()
        if piece is None:
            raw = b""
        elif token_id in self.special_ids or not all(c in table for c in piece):
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        else:
            raw = bytes(table[c] for c in piece)
        return raw.decode("utf-8", errors="replace"), list(raw)


class TokenEvents:
    """One run's `tokens` events by seq, fed by its watch (`observe`); `take(seq)` hands the
    event behind text delta `seq`, reading the log for one the subscription missed."""

    def __init__(self, js: JetStreamContext, request_id: str) -> None:
        self.js, self.request_id = js, request_id
        self.by_seq: dict[int, TokensGenerated] = {}
        self.last_seq: int | None = None  # the last tokens seq, once `finished` was seen
        self.finished = False

    def observe(self, event: AnyEvent) -> None:
        if isinstance(event, TokensGenerated) and event.request_id == self.request_id:
            self.by_seq.setdefault(event.seq, event)
        elif isinstance(event, RunFinished) and event.request_id == self.request_id:
            self.finished, self.last_seq = True, event.last_seq

    def _past_the_end(self, seq: int) -> bool:
        return self.finished and (self.last_seq is None or seq > self.last_seq)

    async def take(self, seq: int) -> TokensGenerated | None:
        if seq not in self.by_seq and not self._past_the_end(seq):
            await self._read_log()
        return self.by_seq.pop(seq, None)

    async def _read_log(self) -> None:
        """Every stored `tokens` event of the run: the tokens event behind a text delta is
        stored before the detokenizer reads it, so the log has it."""
        subject = subjects.event_subject(self.request_id, "tokens")
        sub = await self.js.subscribe(subject, stream=subjects.EVENTS_STREAM, ordered_consumer=True)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except nats.errors.TimeoutError:
                    break
                self.observe(decode_event(msg.data))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    info = await sub.consumer_info()
                    await sub.unsubscribe()
                    await self.js.delete_consumer(subjects.EVENTS_STREAM, info.name)
                except (nats.errors.Error, NotFoundError):
                    pass  # already gone: the server drops an ephemeral consumer without interest


class Logprobs:
    """One choice's logprobs, added tokens event by tokens event; `chat` picks the shape and
    `num_top` the alternatives per token (the engine sends the sampled one, then the top-n)."""

    def __init__(self, text: TokenText, *, chat: bool, num_top: int) -> None:
        self.text, self.chat, self.num_top = text, chat, num_top
        self.stopped = False  # a stop string ended the text: later tokens are not shown
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0  # characters of text before the next token (completions' text_offset)
        self.content: list[dict[str, Any]] = []  # chat, all so far
        self.legacy: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip

    def add(self, event: TokensGenerated | None) -> dict[str, Any] | None:
        """This event's part (for a streamed chunk), also kept for the whole answer; None when
        it shows no token."""
        if event is None or self.stopped:
            return None
        if event.logprobs is None or len(event.logprobs) != len(event.token_ids):
            raise RuntimeError(
                f"run {event.request_id}: tokens event {event.seq} has no logprobs for its "
                f"{len(event.token_ids)} tokens although the request asked for them"
            )
        part: list[dict[str, Any]] = []
        legacy: dict[str, list[Any]] = {k: [] for k in self.legacy}
        for token_id, ranked in zip(event.token_ids, event.logprobs, strict=True):
            if token_id in self.text.special_ids:
                continue
            sampled, top = ranked[0], ranked[1 : 1 + self.num_top]
            token, raw = self.text(token_id)
            if self.chat:
                part.append(
                    {
                        "token": token,
                        "logprob": sampled.logprob,
                        "bytes": raw,
                        "top_logprobs": [self._entry(t.token_id, t.logprob) for t in top],
                    }
                )
            else:
                self._legacy_token(legacy, token_id, sampled.logprob, top)
        if self.chat:
            self.content.extend(part)
            return {"content": part, "refusal": None} if part else None
        for key, values in legacy.items():
            self.legacy[key].extend(values)
        return legacy if legacy["tokens"] else None

    def add_prompt(
        self, prompt_token_ids: list[int], ranked: list[list[TokenLogprob]]
    ) -> dict[str, list[Any]]:
        """The prompt's part (echo, completions only): `ranked[i]` is prompt token i + 1's
        (that token first, then the top-n); the first token has a null logprob."""
        assert not self.chat, "echo is the completions API's"
        ids = [e[0].token_id for e in ranked]
        if ids != prompt_token_ids[1:]:
            raise RuntimeError(
                f"the prompt logprobs are of tokens {ids[:5]}..., not the prompt's "
                f"{prompt_token_ids[1:6]}..."
            )
        legacy: dict[str, list[Any]] = {k: [] for k in self.legacy}
        self._legacy_token(legacy, prompt_token_ids[0], None, None)
        for entry in ranked:
            self._legacy_token(
                legacy, entry[0].token_id, entry[0].logprob, entry[1 : 1 + self.num_top]
            )
        for key, values in legacy.items():
            self.legacy[key].extend(values)
        return legacy

    def _legacy_token(
        self,
        legacy: dict[str, list[Any]],
        token_id: int,
        logprob: float | None,
        top: list[TokenLogprob] | None,
    ) -> None:
        token, raw = self.text(token_id)
        legacy["tokens"].append(token)
        legacy["token_logprobs"].append(logprob)
        alternatives = None
        if top is not None and logprob is not None:
            alternatives = {self.text(t.token_id)[0]: t.logprob for t in top}
            alternatives.setdefault(token, logprob)
        legacy["top_logprobs"].append(alternatives)
        legacy["text_offset"].append(self._offset)
        self._offset += len(self._utf8.decode(bytes(raw)))

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token, raw = self.text(token_id)
        return {"token": token, "logprob": logprob, "bytes": raw}

    def whole(self) -> dict[str, Any]:
        return {"content": self.content, "refusal": None} if self.chat else self.legacy
