"""Constrained decoding on llguidance: a request's Constraint compiled once per canonical key,
and a per-sequence matcher that gives the next token's allowed set as a bitmask row and follows
the tokens the sequence receives.

Invariant: a matcher's state is a function of its constraint and of the output tokens it has
accepted, in order; the same tokens give the same masks, so a re-run or replay stays exact.
"""

from __future__ import annotations

import collections
import functools
import json

import llguidance
import llguidance.numpy
import numpy as np

from engine.errors import RequestRejected
from engine.params import Constraint
from engine.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256
# JSON is generated compact (no whitespace between tokens): a small model left free to emit
# whitespace can fill max_tokens with it and never close the object
JSON_OPTIONS = {"whitespace_flexible": False}
SPECIAL_MARKER = b"\xff"  # llguidance: a token whose bytes start with 0xff is special, never text
FIELDS = {  # the request field each kind comes from, for a rejection
    "json_object": "response_format",
    "json_schema": "response_format.json_schema",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}


def mask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row: bit t % 32 of word t // 32 is token t."""
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onwards in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table |= {chr(0x100 + i): b for i, b in enumerate(others)}
    return table


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes: byte-level pieces decoded, special tokens marked, ids past the
    tokenizer (a model's padded vocabulary) empty, which llguidance never allows."""
    decoder = _gpt2_byte_decoder()
    out: list[bytes] = []
    for i in range(vocab_size):
        piece = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else None
        if piece is None:
            out.append(b"")
        elif i in tokenizer.special_token_ids:
            out.append(SPECIAL_MARKER + piece.encode())
        elif all(c in decoder for c in piece):
            out.append(bytes(decoder[c] for c in piece))
        else:  # an added (user-defined) token is stored as its own text
            out.append(piece.encode())
    return out


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: the tokens' bytes, eos/bos, special ids, and a
    call that tokenizes text (it is given str: `encode` refuses bytes)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokens = token_bytes(tokenizer, vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint, not yet checked (`check` does)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', JSON_OPTIONS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:  # grammar: Lark, or llama.cpp's GBNF (converted to Lark)
        return llguidance.grammar_from("grammar", spec)
    except ValueError as err:
        raise _rejected(constraint, str(err)) from None


def check(constraint: Constraint, lltokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The llguidance grammar of `constraint`, checked; RequestRejected naming the problem when
    its schema, regex or grammar is invalid or uses what llguidance does not support. Without a
    vocabulary (the gateway, before a request is accepted) only the grammar itself is checked."""
    grammar = grammar_text(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer)
    if is_error:
        raise _rejected(constraint, "; ".join(messages))
    return grammar


def _rejected(constraint: Constraint, problem: str) -> RequestRejected:
    field = FIELDS[constraint.kind]
    return RequestRejected(
        "invalid_request", f"{field}: the {constraint.kind} is invalid: {problem}", field=field
    )


class GrammarCache:
    """One model's vocabulary for llguidance and its compiled grammars, by constraint key.

    A compiled grammar is kept as a matcher in its start state; each sequence gets a deep copy,
    which shares the compiled grammar and its lexer (llguidance's copy is cheap)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size))
        self.lltokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self._compiled: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._executor: llguidance.LLExecutor | None = None
        self.num_compiled = 0  # grammars compiled (cache misses)

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The start-state matcher of `constraint`; RequestRejected as `check`."""
        key = constraint.key
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            return found
        matcher = llguidance.LLMatcher(
            self.lltokenizer, check(constraint, self.lltokenizer), log_level=0
        )
        if matcher.is_error():
            raise _rejected(constraint, matcher.get_error())
        self.num_compiled += 1
        self._compiled[key] = matcher
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self.compile(constraint).deep_copy(), self.eos_token_id)

    def fill_masks(self, matchers: list[Matcher]) -> np.ndarray:
        """[len(matchers), mask_words(vocab)] int32: row i allows the tokens matchers[i] can
        take next (eos only when its output is complete). Computed in parallel on llguidance's
        threads when there are several."""
        bitmask = np.zeros((len(matchers), mask_words(self.vocab_size)), dtype=np.int32)
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0].llmatcher, bitmask, 0)
        elif matchers:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            pairs = [(m.llmatcher, i) for i, m in enumerate(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        for i, m in enumerate(matchers):
            assert not m.llmatcher.is_error(), f"matcher {i}: {m.llmatcher.get_error()}"
        return bitmask


class Matcher:
    """One sequence's position in its grammar: how many of its output tokens it has taken."""

    def __init__(self, llmatcher: llguidance.LLMatcher, eos_token_id: int) -> None:
        self.llmatcher = llmatcher
        self.eos_token_id = eos_token_id
        self.num_accepted = 0
        self.num_followed = 0  # of the sequence's own output tokens

    def accept(self, token_id: int) -> None:
        """Advance past one sampled token; it was allowed by the mask, so it must be taken."""
        ok = self.llmatcher.consume_token(token_id)
        assert ok, f"token {token_id} outside the grammar: {self.llmatcher.get_error()}"
        self.num_accepted += 1

    def resume(self, token_ids: list[int]) -> bool:
        """Take the output of an earlier run of the request (now the end of its prompt), so that
        the run goes on from where it was in the grammar; False if they do not follow it."""
        assert self.num_accepted == 0, "resume() comes before any output"
        if self.llmatcher.try_consume_tokens(list(token_ids)) != len(token_ids):
            return False
        self.num_accepted = len(token_ids)
        return True

    def follow(self, output_token_ids: list[int]) -> None:
        """Accept the sequence's output tokens it has not taken yet (those since the last call)."""
        for token_id in output_token_ids[self.num_followed :]:
            self.accept(token_id)
        self.num_followed = len(output_token_ids)

    @property
    def is_complete(self) -> bool:
        """Nothing but eos may follow: the output is a whole match and cannot grow."""
        return self.llmatcher.is_stopped()
