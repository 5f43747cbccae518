"""SamplingParams: how one request turns logits into tokens, validated when built.

Every invalid value raises RequestRejected (a ValueError) with the field, the value and the
allowed range. A `Constraint` (structured output) is checked for its form here; whether its
schema, regex or grammar compiles is checked by the engine at add_request (engine/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from engine.errors import RequestRejected

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +100 all but forces a token, -100 all but bans it

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise RequestRejected(
            "invalid_request",
            f"SamplingParams.{field}={value!r} is invalid; allowed: {allowed}",
            field=field,
        )


@dataclass(frozen=True)
class Constraint:
    """What the output must match: any JSON object, a JSON schema, a regex, one of a list of
    strings, or a grammar (Lark or GBNF). `spec` is text: the schema as JSON, the regex, the
    choices as a JSON list of strings, the grammar. A JSON spec is stored without whitespace,
    so equal schemas share one compiled grammar; its key order is kept (the order of a schema's
    properties is the order they are generated in)."""

    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in CONSTRAINT_KINDS, "constraint.kind", self.kind, str(CONSTRAINT_KINDS))
        _check(isinstance(self.spec, str), "constraint.spec", self.spec, "a str")
        if self.kind == "json_object":
            _check(self.spec == "", "constraint.spec", self.spec, "'' for json_object")
        elif self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as err:
                raise RequestRejected(
                    "invalid_request",
                    f"SamplingParams.constraint.spec is not valid JSON for {self.kind}: {err}",
                    field="constraint.spec",
                ) from None
            if self.kind == "json_schema":
                _check(
                    isinstance(value, dict | bool),
                    "constraint.spec",
                    self.spec[:80],
                    "a JSON schema (an object or a boolean)",
                )
            else:
                _check(
                    isinstance(value, list)
                    and len(value) > 0
                    and all(isinstance(c, str) and c for c in value),
                    "constraint.spec",
                    self.spec[:80],
                    "a non-empty JSON list of non-empty strings",
                )
            canonical = json.dumps(value, separators=(",", ":"))
            object.__setattr__(self, "spec", canonical)
        else:
            _check(bool(self.spec), "constraint.spec", self.spec, f"a non-empty {self.kind}")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> Constraint:
        return cls("choice", json.dumps(list(choices)))

    @property
    def key(self) -> tuple[str, str]:
        """The cache key of its compiled grammar."""
        return (self.kind, self.spec)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int | None = None  # None -> the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None -> the engine assigns one and reports it
    max_tokens: int = 16
    min_tokens: int = 0  # eos and stop ids are masked until this many tokens exist
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (the sampled one first)
    # top-n logprobs of each prompt token after the first (the prompt's own token first); the
    # request then computes its whole prompt (no prefix-cache hits)
    prompt_logprobs: int | None = None
    # (token id, bias) pairs, ids ascending: the bias is added to the token's logit after the
    # penalties (a dict is taken and sorted); the engine checks the ids against its vocabulary
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output: only tokens that keep the output a prefix of a match are sampled, and
    # the request ends when the match is complete (engine/grammar.py)
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

        def real(x: object) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and x == x

        def integer(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        t = self.temperature
        _check(real(t) and 0.0 <= t <= 100.0, "temperature", t, "0 <= temperature <= 100")
        _check(real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "0 < top_p <= 1")
        _check(
            self.top_k is None or (integer(self.top_k) and self.top_k >= 1),
            "top_k",
            self.top_k,
            "None or an integer >= 1",
        )
        _check(
            real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "0 <= min_p <= 1"
        )
        rp = self.repetition_penalty
        _check(real(rp) and 0.0 < rp <= 10.0, "repetition_penalty", rp, "0 < x <= 10")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(real(v) and -2.0 <= v <= 2.0, name, v, "-2 <= x <= 2")
        _check(
            self.seed is None or (integer(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "None or an integer in [0, 2**63)",
        )
        _check(
            integer(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        _check(
            isinstance(self.stop_token_ids, tuple)
            and all(integer(i) and i >= 0 for i in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a tuple of integers >= 0",
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "True or False")
        _check(
            self.logprobs is None
            or (integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            self.logprobs,
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None
            or (integer(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            self.prompt_logprobs,
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(
            isinstance(self.logit_bias, tuple)
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and integer(pair[0])
                and pair[0] >= 0
                and real(pair[1])
                and -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS
                for pair in self.logit_bias
            )
            and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
            "logit_bias",
            self.logit_bias[:5] if isinstance(self.logit_bias, tuple) else self.logit_bias,
            f"a dict of token id >= 0 -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        _check(
            self.constraint is None or isinstance(self.constraint, Constraint),
            "constraint",
            self.constraint,
            "None or a Constraint",
        )
        if self.constraint is not None:
            # the grammar decides where the output ends: eos is allowed exactly when it is
            # complete, so neither a floor on its length nor ignoring eos can be honoured
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens, "0 with a constraint")
            _check(not self.ignore_eos, "ignore_eos", self.ignore_eos, "False with a constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
