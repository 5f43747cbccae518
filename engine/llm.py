"""LLM: the offline, vLLM-shaped entry point. generate() and chat() run the engine to completion.

Outputs come back in the order of the prompts, whatever order the requests finished in.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.engine import Engine, EngineConfig
from engine.params import SamplingParams

Prompt = str | list[int]
Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[list[tuple[int, float]]] | None  # per token: sampled, then top-n
    seed: int


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype: str = "float32", **engine_kwargs):
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priority: int = 0,
    ) -> list[RequestOutput]:
        """Prompts are strings (encoded without special tokens) or lists of token ids."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        token_lists = [p if _is_token_ids(p) else self.tokenizer.encode(p) for p in prompts]
        return self._run(token_lists, params, priority)

    def chat(
        self,
        messages: Conversation | Seq[Conversation],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        priority: int = 0,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.tokenizer.encode_chat(list(c)) for c in conversations]
        return self._run(token_lists, params, priority)

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None,
        priority: int,
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"{len(params)} SamplingParams for {len(token_lists)} prompts")
        request_ids = [f"llm-{next(self._ids)}" for _ in token_lists]
        seeds: dict[str, int] = {}
        try:
            for rid, ids, p in zip(request_ids, token_lists, params, strict=True):
                seeds[rid] = self.engine.add_request(rid, ids, p, priority)
        except ValueError:
            for rid in seeds:
                self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        logprobs: dict[str, list[list[tuple[int, float]]]] = {rid: [] for rid in request_ids}
        reasons: dict[str, str | None] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.new_logprobs is not None:
                    logprobs[out.request_id] += out.new_logprobs
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [
            RequestOutput(
                request_id=rid,
                prompt_token_ids=ids,
                token_ids=tokens[rid],
                text=self.tokenizer.decode(tokens[rid]),
                finish_reason=reasons.get(rid),
                logprobs=logprobs[rid] if p.logprobs is not None else None,
                seed=seeds[rid],
            )
            for rid, ids, p in zip(request_ids, token_lists, params, strict=True)
        ]


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)
