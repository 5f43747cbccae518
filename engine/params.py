"""SamplingParams: how one request turns logits into tokens, validated when built.

Every invalid value raises RequestRejected (a ValueError) with the field, the value and the
allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestRejected

MAX_LOGPROBS = 20


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise RequestRejected(
            "invalid_request",
            f"SamplingParams.{field}={value!r} is invalid; allowed: {allowed}",
            field=field,
        )


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

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
