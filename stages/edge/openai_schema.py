"""OpenAI HTTP schemas <-> Brigade: a chat or completions body becomes a `Submit`; a run's text,
logprobs and usage become `chat.completion(.chunk)` / `text_completion` bodies (errors: errors.py).

Every parameter is honoured, refused by name or harmlessly ignored (openai_params.PARAMS); an
unknown one is refused. Sampling fields carry the wire's own bounds (schemas.events.Submit), so a
bad value is refused here, naming the request's field. finish_reason is one of the SDK's: a
cancelled run reads "stop" (its state stays in GET /v1/runs/{id}).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, get_args

import msgspec
from msgspec import Meta, Struct

from schemas.bounded import JsonBoundsError, decode_bounded
from schemas.events import (
    MAX_LOGIT_BIAS,
    VOCAB_CEILING,
    DeadlineS,
    Retrieval,
    RunCancelled,
    RunCompleted,
    Submit,
    Usage,
)
from stages.edge.errors import RequestError
from stages.edge.openai_messages import (
    ChatMessage,
    check_message,
    validate_messages,
    wire_messages,
)
from stages.edge.openai_params import CHAT, COMPLETIONS, check_params
from stages.edge.tool_calls import (
    NamedToolChoice,
    ToolChoice,
    Tools,
    check_tools,
    tool_grammar,
)

_WIRE = {f.name: f.type for f in msgspec.structs.fields(Submit)}
Temperature = _WIRE["temperature"]
TopP = _WIRE["top_p"]
MinP = _WIRE["min_p"]
MaxTokens = _WIRE["max_tokens"]
MinTokens = _WIRE["min_tokens"]
Seed = _WIRE["seed"]
ResponseFormat = _WIRE["response_format"]
GuidedJson = _WIRE["guided_json"]
GuidedRegex = _WIRE["guided_regex"]
GuidedChoice = _WIRE["guided_choice"]
GuidedGrammar = _WIRE["guided_grammar"]
Stop = _WIRE["stop"]
StopString = get_args(get_args(Stop)[0])[0]  # one stop string, with the wire's bounds
StopTokenIds = _WIRE["stop_token_ids"]
RepetitionPenalty = _WIRE["repetition_penalty"]
Penalty = _WIRE["presence_penalty"]
# OpenAI's logit_bias: token ids as JSON keys (text) -> bias; to_submit makes the keys ints
# and the wire's type bounds the biases
LogitBias = Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)]
ChatTopLogprobs = Annotated[int, Meta(ge=0, le=20)]
CompletionLogprobs = Annotated[int, Meta(ge=0, le=5)]  # OpenAI's legacy bound


class StreamOptions(Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False


MAX_N = 16  # choices (n) or candidates (best_of) per prompt
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]


class _Common(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    n: NumChoices | None = None  # choices per prompt, sampled in parallel
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    stop: StopString | Stop | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None  # ignored (openai_params)
    # vLLM-style extras, sent by the openai SDK through `extra_body`
    top_k: int | None = None  # -1 or 0: off
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    logit_bias: LogitBias | None = None
    # structured output (the gateway checks that at most one is set and that it compiles)
    response_format: ResponseFormat = None
    guided_json: GuidedJson = None
    guided_regex: GuidedRegex = None
    guided_choice: GuidedChoice = None
    guided_grammar: GuidedGrammar = None
    # Brigade's extension: seconds to wait for a first token (X-Brigade-Deadline-S wins)
    deadline_s: DeadlineS | None = None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: ChatTopLogprobs | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None  # ignored
    retrieval: Retrieval | None = None  # Brigade's extension: the tenant's collections to search

    @property
    def tool_mode(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def calls_tools(self) -> bool:
        """The output may hold tool calls: tools given, and tool_choice not "none"."""
        return bool(self.tools) and self.tool_mode != "none"

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine must return; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any]  # a string, or a list of strings, of token ids or of id lists
    logprobs: CompletionLogprobs | None = None
    echo: bool | None = None  # the prompt before the completion (with logprobs: its tokens')
    best_of: NumChoices | None = None  # candidates per prompt; the n most likely are answered

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


OpenAIRequest = ChatCompletionRequest | CompletionRequest
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN_RE = re.compile(r"unknown field `([^`]+)`")
_AT_RE = re.compile(r" - at (?:`key` in )?`\$(.*)`$")  # a dict's key: the dict


def param_of(err: msgspec.ValidationError) -> str | None:
    """The request field a msgspec error is about, as `messages[0].role` (None: the body)."""
    text = str(err)
    at = _AT_RE.search(text)
    path = at.group(1).lstrip(".") if at else ""
    named = _MISSING_RE.search(text) or _UNKNOWN_RE.search(text)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


def _detail(err: msgspec.ValidationError) -> str:
    return _AT_RE.sub("", str(err))


def decode_json(body: bytes) -> Any:
    """The body's JSON, bounded in depth (schemas.bounded), or a 400 naming where it is not."""
    try:
        return decode_bounded(None, body)
    except JsonBoundsError as err:
        message = f"invalid `{err.field or 'body'}`: {_detail(err)}"
        raise RequestError("invalid_request", message, err.field) from None
    except msgspec.DecodeError as err:
        raise RequestError("invalid_request", f"request body is not valid JSON: {err}") from None


def decode_body(body: bytes, kind: type[OpenAIRequest]) -> Any:
    """The request, or a 400 naming the parameter: unknown, refused, of the wrong type or out
    of range, or missing."""
    raw = decode_json(body)
    if not isinstance(raw, dict):
        raise RequestError(
            "invalid_request", f"the request body must be a JSON object, not {type(raw).__name__}"
        )
    endpoint = CHAT if kind is ChatCompletionRequest else COMPLETIONS
    raw = check_params(raw, endpoint)
    if endpoint == CHAT and "messages" in raw:
        raw["messages"] = validate_messages(raw["messages"])
    try:
        req = msgspec.convert(raw, kind)
    except msgspec.ValidationError as err:
        param = param_of(err)
        missing = _MISSING_RE.search(str(err)) is not None
        message = (
            f"missing required parameter `{param}`"
            if missing
            else f"invalid `{param or 'body'}`: {_detail(err)}"
        )
        raise RequestError("invalid_request", message, param) from None
    _check_together(req)
    return req


def _check_together(req: OpenAIRequest) -> None:
    if isinstance(req, CompletionRequest) and req.best_of is not None:
        if req.best_of < (req.n or 1):
            raise RequestError(
                "invalid_request", f"best_of={req.best_of} is below n={req.n}; best_of >= n",
                "best_of",
            )  # fmt: skip
        if req.stream and req.best_of > (req.n or 1):
            raise RequestError(
                "invalid_request",
                "best_of > n cannot be streamed: the best candidates are known only at the end",
                "best_of",
            )
    for key in req.logit_bias or {}:
        if not key.isascii() or not key.isdigit():
            raise RequestError(
                "invalid_request",
                f"logit_bias: the key {key[:20]!r} is not a token id (a non-negative integer)",
                "logit_bias",
            )
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "invalid_request", "stream_options is only allowed with stream: true", "stream_options"
        )
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError(
                "invalid_request", "top_logprobs needs logprobs: true", "top_logprobs"
            )
        if not req.messages:
            raise RequestError("invalid_request", "messages must not be empty", "messages")
        for i, m in enumerate(req.messages):
            check_message(i, m)
        check_tools(req.tools or [], req.tool_mode)
        if req.calls_tools and _structured(req):
            raise RequestError(
                "invalid_request",
                f"tool_choice {_show_choice(req.tool_mode)} with tools constrains the output to "
                "the tools' calls; it cannot also follow response_format or a guided_* field "
                '(set tool_choice: "none", or drop the structured-output field)',
                "tool_choice",
            )
    else:
        prompts_of(req)


MAX_PROMPTS = 128  # prompts of one completions request, each its own run and choice
Prompt = str | list[int]  # text, or the served model's token ids


def prompts_of(req: CompletionRequest) -> list[Prompt]:
    """The request's prompts in order (a 400 naming `prompt[i]` for a malformed one): a string,
    a list of strings, a list of token ids (one prompt) or a list of id lists."""
    raw = req.prompt
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise RequestError("invalid_request", "prompt is an empty list", "prompt")
    if all(_is_id(t) for t in raw):
        return [_ids(raw, "prompt")]
    prompts: list[Prompt] = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list) and p:
            prompts.append(_ids(p, f"prompt[{i}]"))
        else:
            raise RequestError(
                "invalid_request",
                f"prompt[{i}] must be a string or a non-empty list of token ids, got "
                f"{type(p).__name__}" + (" (empty)" if p == [] else ""),
                f"prompt[{i}]",
            )
    runs = len(prompts) * num_candidates(req)
    if runs > MAX_PROMPTS:
        raise RequestError(
            "invalid_request",
            f"prompt holds {len(prompts)} prompts, {runs} runs with n / best_of; at most "
            f"{MAX_PROMPTS} runs per request",
            "prompt",
        )
    return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list[Any], field: str) -> list[int]:
    for j, t in enumerate(values):
        if not _is_id(t) or not 0 <= t < VOCAB_CEILING:
            raise RequestError(
                "invalid_request",
                f"{field}[{j}]={t!r} is not a token id (an integer in [0, {VOCAB_CEILING}))",
                f"{field}[{j}]",
            )
    return list(values)


def _structured(req: OpenAIRequest) -> bool:
    fmt = req.response_format
    other = (req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    return (fmt is not None and fmt.type != "text") or any(v is not None for v in other)


def _show_choice(choice: ToolChoice) -> str:
    return f"{choice.function.name!r}" if isinstance(choice, NamedToolChoice) else f"{choice!r}"


_SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def num_candidates(req: OpenAIRequest) -> int:
    """Runs per prompt: best_of for completions (when given), else n."""
    n = req.n or 1
    return max(n, req.best_of or n) if isinstance(req, CompletionRequest) else n


def ranks_candidates(req: OpenAIRequest) -> bool:
    """best_of > n: the runs are ranked by their output's cumulative logprob."""
    return num_candidates(req) > (req.n or 1)


def to_submits(req: OpenAIRequest, **extra: Any) -> list[Submit]:
    """One submit per run: for each prompt (a chat request has one), num_candidates runs. With
    more than one run, run r gets request id `<id>-<r>` and idempotency key `<key>#<r>`; a
    prompt's runs after its first name that first in `fork_of` (the engine shares the prompt's
    K/V) and sample with seed + j when a seed is given."""
    prompts: list[Prompt | None] = [None] if isinstance(req, ChatCompletionRequest) else list(
        prompts_of(req))  # fmt: skip
    per_prompt = num_candidates(req)
    if len(prompts) * per_prompt == 1:
        return [to_submit(req, prompt=prompts[0], **extra)]
    submits = []
    for i, prompt in enumerate(prompts):
        for j in range(per_prompt):
            r = i * per_prompt + j
            more = dict(extra)
            if more.get("request_id"):
                more["request_id"] = f"{extra['request_id']}-{r}"
                if j:
                    more["fork_of"] = f"{extra['request_id']}-{i * per_prompt}"
            if more.get("idempotency_key"):
                more["idempotency_key"] = f"{extra['idempotency_key']}#{r}"
            if req.seed is not None and j:
                more["seed"] = (req.seed + j) % 2**63
            submits.append(to_submit(req, prompt=prompt, **more))
    return submits


def to_submit(req: OpenAIRequest, prompt: Prompt | None = None, **extra: Any) -> Submit:
    """The wire submit of one choice (`prompt`: the completions prompt it answers, the first
    when not given); `extra` carries model, request_id, api_key, idempotency_key."""
    fields: dict[str, Any] = {"model": req.model, **extra}
    if isinstance(req, ChatCompletionRequest):
        fields["messages"] = wire_messages(req.messages, req.tools if req.calls_tools else None)
        if req.retrieval is not None:
            fields["retrieval"] = req.retrieval
        max_tokens = req.max_completion_tokens or req.max_tokens
        parallel = req.parallel_tool_calls is not False  # OpenAI's default: true
        if (lark := tool_grammar(req.tools or [], req.tool_mode, parallel)) is not None:
            fields["guided_grammar"] = lark
    else:
        prompt = prompts_of(req)[0] if prompt is None else prompt
        fields["prompt" if isinstance(prompt, str) else "prompt_token_ids"] = prompt
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
        if req.echo and req.logprobs is not None:
            fields["prompt_logprobs"] = req.logprobs
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    if req.stop is not None:
        fields["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.top_k is not None and req.top_k not in (-1, 0):  # vLLM's "off"
        fields["top_k"] = req.top_k
    if req.num_logprobs is not None:
        fields["logprobs"] = req.num_logprobs
    elif ranks_candidates(req):
        fields["logprobs"] = 0  # the sampled tokens' logprobs rank the candidates
    if req.logit_bias:
        fields["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    for name in _SAMPLING:
        value = getattr(req, name)
        if value is not None:
            fields.setdefault(name, value)  # a run's own (a parallel sample's seed) stands
    try:
        return msgspec.convert(fields, Submit)
    except msgspec.ValidationError as err:
        param = param_of(err)
        if param == "max_tokens" and isinstance(req, ChatCompletionRequest):
            param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise RequestError("invalid_request", f"invalid `{param}`: {_detail(err)}", param) from None


def finish_reason(term: RunCompleted | RunCancelled) -> str:
    """The SDK's finish_reason for a run's end: a cancelled run (a client's cancel, a timeout,
    a disconnect) reads "stop"; GET /v1/runs/{id} keeps state "cancelled"."""
    return term.finish_reason if isinstance(term, RunCompleted) else "stop"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
