"""Every request parameter of POST /v1/chat/completions and /v1/completions, in one table.

A parameter is `honoured`, `refused` (only its no-op value is taken: null, 1, false, "none"...;
any other is a 400 that names it, says why and what is allowed) or `ignored` (harmless: taken and
without effect). A parameter not in the table is a 400 naming it. docs/api.md prints this table
(tests/stages/edge/test_openai_params.py keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from stages.edge.errors import RequestError

Status = Literal["honoured", "refused", "ignored"]
CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
NOT_YET = "not supported by the engine yet"


@dataclass(frozen=True, kw_only=True)
class Param:
    name: str
    status: Status
    note: str
    endpoints: tuple[str, ...] = BOTH
    takes: Callable[[Any], bool] | None = None  # refused: the no-op values taken anyway
    allowed: str = ""  # those values, in words

    def __post_init__(self) -> None:
        assert (self.status == "refused") == (self.takes is not None), (
            f"{self.name}: a refused parameter says which no-op values it takes"
        )


def _null(value: Any) -> bool:
    return value is None


def _null_or(*values: Any) -> Callable[[Any], bool]:
    """None or one of `values`, compared with their type (True is not 1)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _empty_list(value: Any) -> bool:
    return value is None or value == []


def _text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


def _text_modality(value: Any) -> bool:
    return value is None or value == ["text"]


def _honoured(name: str, note: str, endpoints: tuple[str, ...] = BOTH) -> Param:
    return Param(name=name, status="honoured", note=note, endpoints=endpoints)


def _ignored(name: str, note: str, endpoints: tuple[str, ...] = BOTH) -> Param:
    return Param(name=name, status="ignored", note=note, endpoints=endpoints)


def _refused(
    name: str,
    note: str,
    takes: Callable[[Any], bool] = _null,
    allowed: str = "null",
    endpoints: tuple[str, ...] = BOTH,
) -> Param:
    return Param(
        name=name, status="refused", note=note, takes=takes, allowed=allowed, endpoints=endpoints
    )


_OLD_API = "not supported; use tools and tool_choice"
PARAMS: tuple[Param, ...] = (
    # OpenAI's chat and completions parameters, as the `openai` SDK sends them
    _honoured(
        "model",
        "a served model's id (BRIGADE_MODEL; GET /v1/models) or an alias; its engine "
        "workers answer, the reply names the id; any other is a 404 `model_not_found`",
    ),  # fmt: skip
    _honoured(
        "messages",
        "roles system, developer (as system), user, assistant (with tool_calls), tool (with "
        "tool_call_id); text content (a string or text parts)",
        (CHAT,),
    ),  # fmt: skip
    _honoured(
        "prompt",
        "a string, a list of strings, a list of token ids or a list of id lists (up to 128 "
        "prompts, each its own run; choice i answers prompt i)",
        (COMPLETIONS,),
    ),
    _honoured("max_tokens", "1..8192; completions default 16, chat default 256"),
    _honoured("max_completion_tokens", "1..8192; wins over max_tokens", (CHAT,)),
    _honoured("temperature", "0..2; 0 is greedy"),
    _honoured("top_p", "(0, 1]"),
    _honoured("stream", "server-sent events ending in `data: [DONE]`"),
    _honoured("stream_options", "`include_usage`; only with stream: true"),
    _honoured("stop", "a string or up to 16 strings of 1..256 characters"),
    _honoured("presence_penalty", "-2..2"),
    _honoured("frequency_penalty", "-2..2"),
    _honoured("seed", "0..2^63-1: the same seed and request give the same text"),
    _honoured("logprobs", "chat: true/false; completions: 0..5 top alternatives per token"),
    _honoured("top_logprobs", "0..20 alternatives per token; needs logprobs: true", (CHAT,)),
    _honoured(
        "n",
        "1..16 choices per prompt, sampled in parallel: the engine computes the prompt once and "
        "the choices share its KV blocks; with a seed, choice j samples with seed + j",
    ),
    _honoured(
        "best_of",
        "n..16 candidates per prompt (sampled as n is), the n of highest cumulative logprob "
        "answered; not with stream unless equal to n",
        (COMPLETIONS,),
    ),
    _honoured(
        "echo",
        "true: the prompt before the completion; with logprobs, the prompt's tokens first (the "
        "first with a null logprob), as lm-evaluation-harness's loglikelihood reads them",
        (COMPLETIONS,),
    ),
    _refused(
        "suffix",
        "fill-in-the-middle is not supported by the served model",
        _null_or(""),
        'null or ""',
        (COMPLETIONS,),
    ),  # fmt: skip
    _honoured(
        "logit_bias",
        "token id (a JSON key) -> bias in [-100, 100] added to its logit after the penalties, "
        "up to 1024 ids of the served model's vocabulary; +100 all but forces a token, -100 "
        "all but bans it; logprobs stay the model's own",
    ),
    _honoured(
        "response_format",
        "text, json_object or json_schema (its schema enforced token by token by the engine's "
        "grammar-constrained sampler; strict or not); an invalid schema is a 400 naming it",
    ),
    _honoured(
        "tools",
        "up to 128 functions with JSON-schema parameters, rendered into the system prompt in "
        "the Hermes format (below); calls come back as `tool_calls`, streamed as deltas",
        (CHAT,),
    ),
    _honoured(
        "tool_choice",
        '"none" (tools not shown), "auto" (default with tools: text or calls), "required" or '
        "a named function; every call is grammar-constrained to its function's parameters",
        (CHAT,),
    ),
    _honoured(
        "parallel_tool_calls", "false: at most one call (default true: one or more)", (CHAT,)
    ),
    _refused(
        "functions",
        f"the deprecated functions API is {_OLD_API}",
        _empty_list,
        "null or []",
        (CHAT,),
    ),  # fmt: skip
    _refused(
        "function_call",
        f"the deprecated functions API is {_OLD_API}",
        _null_or("none"),
        '"none"',
        (CHAT,),
    ),  # fmt: skip
    _ignored("user", "the tenant comes from the API key; the value is not stored"),
    _ignored("metadata", "OpenAI's tags for stored completions; not stored", (CHAT,)),
    _refused(
        "store",
        "Brigade keeps no store of completions for evals (every run is in the "
        "event log: GET /v1/runs/{id})",
        _null_or(False),
        "false",
        (CHAT,),
    ),  # fmt: skip
    _refused(
        "service_tier",
        "one service tier; a tenant's priority comes with its key",
        _null_or("auto", "default"),
        '"auto" or "default"',
        (CHAT,),
    ),  # fmt: skip
    _refused(
        "modalities", "the served model writes text only", _text_modality, '["text"]', (CHAT,)
    ),  # fmt: skip
    _refused("audio", "the served model writes text only", endpoints=(CHAT,)),
    _refused("prediction", f"predicted outputs are {NOT_YET}", endpoints=(CHAT,)),
    _refused("reasoning_effort", "the served model is not a reasoning model", endpoints=(CHAT,)),
    _refused("web_search_options", "Brigade has no web search", endpoints=(CHAT,)),
    # vLLM's extras (the openai SDK sends them through `extra_body`)
    _honoured("top_k", ">= 1; -1 or 0 turn it off, as in vLLM"),
    _honoured("min_p", "0..1"),
    _honoured("min_tokens", "0..8192, at most max_tokens"),
    _honoured("repetition_penalty", "(0, 2]"),
    _honoured("ignore_eos", "true: generate past the end-of-sequence token"),
    _honoured("stop_token_ids", "up to 64 token ids that end generation"),
    _refused(
        "skip_special_tokens", "the detokenizer always skips special tokens", _null_or(True), "true"
    ),  # fmt: skip
    _refused(
        "include_stop_str_in_output",
        "a stop string is always cut from the text",
        _null_or(False),
        "false",
    ),  # fmt: skip
    _refused(
        "add_generation_prompt",
        "the tokenizer always adds the generation prompt",
        _null_or(True),
        "true",
        (CHAT,),
    ),  # fmt: skip
    _refused(
        "continue_final_message",
        "the tokenizer always starts a new assistant message",
        _null_or(False),
        "false",
        (CHAT,),
    ),  # fmt: skip
    _refused(
        "chat_template", "the served model's own template is always used", endpoints=(CHAT,)
    ),  # fmt: skip
    _refused(
        "chat_template_kwargs", "the served model's own template is always used", endpoints=(CHAT,)
    ),  # fmt: skip
    _refused(
        "prompt_logprobs",
        "vLLM's shape of prompt logprobs is not served; /v1/completions with echo and logprobs "
        "gives them in OpenAI's",
    ),
    _refused("use_beam_search", f"beam search is {NOT_YET}", _null_or(False), "false"),
    _honoured(
        "guided_json",
        "a JSON schema (object or its JSON text) the output follows; at most one structured-output field",
    ),
    _honoured(
        "guided_regex",
        "a regular expression the output matches; at most one structured-output field",
    ),
    _honoured(
        "guided_choice",
        "the output is exactly one of these strings; at most one structured-output field",
    ),
    _honoured(
        "guided_grammar",
        "a Lark or GBNF grammar the output follows; at most one structured-output field",
    ),
    # Brigade's extension (`extra_body`)
    _honoured(
        "retrieval",
        "{collections: [1..8 of the tenant's collection names], top_k: 1..64 (5), "
        "over_retrieve: 1..16, rerank: true, query}: chunks of the tenant's collections, "
        "searched, reranked and packed into the prompt as quoted data",
        (CHAT,),
    ),
    _honoured(
        "deadline_s",
        "seconds (up to 86400) the request may wait for its first token, for an engine, before "
        "it is cancelled; the X-Brigade-Deadline-S header wins (docs/api.md)",
    ),
)
BY_ENDPOINT: dict[str, dict[str, Param]] = {
    e: {p.name: p for p in PARAMS if e in p.endpoints} for e in BOTH
}


def taken(endpoint: str) -> list[str]:
    """The parameters an endpoint honours or ignores (the refused ones take only no-ops)."""
    return [p.name for p in BY_ENDPOINT[endpoint].values() if p.status != "refused"]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_params(raw: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """Refuse unknown parameters and refused values by name; returns the body without the
    refused parameters' no-op values (what remains is typed by the request struct)."""
    table = BY_ENDPOINT[endpoint]
    kept: dict[str, Any] = {}
    for name, value in raw.items():
        param = table.get(name)
        if param is None:
            elsewhere = [e for e in BOTH if name in BY_ENDPOINT[e]]
            hint = (
                f"it belongs to {PATHS[elsewhere[0]]}"
                if elsewhere
                else f"{PATHS[endpoint]} takes: {', '.join(sorted(taken(endpoint)))} (the "
                "table of every parameter: docs/api.md)"
            )
            raise RequestError(
                "unknown_parameter", f"unknown parameter `{name}`; {hint}", str(name)[:64]
            )
        if param.takes is None:
            kept[name] = value
        elif not param.takes(value):
            raise RequestError(
                "unsupported_parameter",
                f"`{name}`={_show(value)} is not supported: {param.note}; allowed: {param.allowed}",
                name,
            )
    return kept


BEGIN = "<!-- params:begin: generated from stages/edge/openai_params.py -->"
END = "<!-- params:end -->"
_WHERE = {BOTH: "both", (CHAT,): "chat", (COMPLETIONS,): "completions"}


def markdown_table() -> str:
    """docs/api.md's table of every parameter, between BEGIN and END."""
    rows = [
        "| parameter | endpoint | status | what Brigade does |",
        "|---|---|---|---|",
    ]
    for p in PARAMS:
        status = f"refused unless {p.allowed}" if p.status == "refused" else p.status
        rows.append(f"| `{p.name}` | {_WHERE[p.endpoints]} | {status} | {p.note} |")
    return "\n".join([BEGIN, *rows, END])
