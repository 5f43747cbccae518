"""Detokenize: token ids -> text deltas, stateless per event (any worker can take any event).

Each `tokens` event carries the tokens before it (`context_token_ids`); its text is what
decode(context + new) adds to decode(context). A trailing incomplete UTF-8 character and any
tail that could still become a stop string are held back; the `finished` flush releases them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from schemas import models
from schemas.events import (
    CancelRequested,
    Event,
    RunCancelled,
    RunCompleted,
    RunFinished,
    TextGenerated,
    TokensGenerated,
    decoder_for,
)
from stages.runtime import worker as runtime
from stages.runtime.spec import StageSpec

STAGE = "detokenize"
INPUTS = ("tokens", "finished")
REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode writes for bytes that are not (yet) a character
MAX_UTF8_TOKENS = 3  # a character has at most 4 bytes, so at most 3 tokens hold a cut-off start
LATE_TOKENS = 32  # tokens the engine may still generate after a stop string, before it aborts


class TextDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def context_window(stop: list[str]) -> int:
    """How many earlier tokens a `tokens` event must carry (all since generation start when
    fewer) for this stage to handle it alone.

    Every non-special token holds at least one byte. A window cut inside a character decodes to
    replacement characters at its start; with 8+ tokens some whole character follows them, so
    the cut never looks like a trailing incomplete character. A stop string of n bytes spans at
    most n tokens; the window keeps a found stop string in sight for LATE_TOKENS more tokens.
    """
    longest = max((len(s.encode()) for s in stop), default=0)
    stop_tokens = longest + LATE_TOKENS if longest else 0
    return 2 * MAX_UTF8_TOKENS + 2 + stop_tokens


def _held_back(text: str, stop: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def _first_stop(text: str, stop: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def visible(text: str, stop: list[str], *, final: bool) -> tuple[str, bool]:
    """The part of `text` that may be shown: cut at the first stop string (-> stopped=True),
    else all of it when `final`, else all but a tail that may still grow into a stop string."""
    at = _first_stop(text, stop)
    if at is not None:
        return text[:at], True
    if final or not stop:
        return text, False
    return text[: len(text) - _held_back(text, stop)], False


class Detokenizer:
    """The pure handler: one `tokens` event -> one `text` (+ `cancel` on a stop string);
    `finished` -> the flush `text` and then `completed` or `cancelled`. Each event is decoded
    by its model's tokenizer (`for_model(id)`); an event that names none, by `tokenizer`."""

    def __init__(
        self, tokenizer: TextDecoder, for_model: Callable[[str], TextDecoder] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.for_model = for_model
        self._by_model: dict[
            str, TextDecoder
        ] = {}  # only served models': a lookup that fails is not kept

    def handle(self, event: Event) -> list[Event]:
        match event:
            case TokensGenerated():
                return self.on_tokens(event)
            case RunFinished():
                return self.on_finished(event)
        raise TypeError(f"detokenize takes `tokens` and `finished` events, not {type(event)}")

    def _decoder(self, event: TokensGenerated | RunFinished) -> TextDecoder:
        if event.model is None or self.for_model is None:
            return self.tokenizer
        found = self._by_model.get(event.model)
        if found is None:  # once a model: the lookup reads the settings (3 % of a token's CPU)
            found = self._by_model[event.model] = self.for_model(event.model)
        return found

    @staticmethod
    def _complete(tokenizer: TextDecoder, ids: list[int]) -> str:
        """Decoded text without a trailing incomplete character (held back until it completes)."""
        text = tokenizer.decode(ids)
        return text[:-1] if text.endswith(REPLACEMENT) else text

    def on_tokens(self, event: TokensGenerated) -> list[Event]:
        tok = self._decoder(event)
        context = list(event.context_token_ids)
        before, stopped_before = visible(self._complete(tok, context), event.stop, final=False)
        after, stopped = visible(
            self._complete(tok, context + event.token_ids), event.stop, final=False
        )
        if stopped_before:  # a late event: an earlier one already ended the text
            return [self._text(event, "", stopped=False)]
        out: list[Event] = [self._text(event, after[len(before) :], stopped=stopped)]
        if stopped:
            out.append(
                CancelRequested(
                    request_id=event.request_id,
                    tenant=event.tenant,
                    reason="stop_string",
                    seq=event.seq,
                )
            )
        return out

    def on_finished(self, event: RunFinished) -> list[Event]:
        tok = self._decoder(event)
        ids = list(event.context_token_ids)
        shown, _ = visible(self._complete(tok, ids), event.stop, final=False)
        full, cut = visible(tok.decode(ids), event.stop, final=True)
        flush_seq = 0 if event.last_seq is None else event.last_seq + 1
        rid, tenant = event.request_id, event.tenant
        flush = TextGenerated(
            request_id=rid, tenant=tenant, seq=flush_seq, text=full[len(shown) :], stopped=cut
        )
        aborted = event.finish_reason == "abort" and event.cancel_reason != "stop_string"
        if aborted:
            return [
                flush,
                RunCancelled(
                    request_id=rid,
                    tenant=tenant,
                    reason=event.cancel_reason or "client",
                    usage=event.usage,
                    last_seq=flush_seq,
                ),
            ]
        reason = "stop" if cut or event.finish_reason != "length" else "length"
        done = RunCompleted(
            request_id=rid,
            tenant=tenant,
            finish_reason=reason,
            usage=event.usage,
            last_seq=flush_seq,
            seed=event.seed,
        )
        return [flush, done]

    @staticmethod
    def _text(event: TokensGenerated, text: str, *, stopped: bool) -> TextGenerated:
        return TextGenerated(
            request_id=event.request_id,
            tenant=event.tenant,
            seq=event.seq,
            text=text,
            stopped=stopped,
        )


async def _setup(ctx: runtime.StageContext) -> Detokenizer:
    from stages.tokenize import model_tokenizer, tokenizer_for  # the engine's models, as tokenize

    for model in models.served():  # every served model's tokenizer loaded before the first event
        tokenizer_for(model.artifact)
    return Detokenizer(model_tokenizer(None), for_model=model_tokenizer)


def _handle(event: Event, state: Detokenizer) -> list[Event]:
    return state.handle(event)


# One durable over both inputs: each event is handled alone, so `tokens` and `finished` need no
# order between them. Cancelled runs are not skipped: their `finished` must become `cancelled`.
SPEC = StageSpec(
    name=STAGE,
    input_event=INPUTS,
    decoder=decoder_for(TokensGenerated, RunFinished),
    handle=_handle,
    setup=_setup,
    skip_cancelled=False,
)
