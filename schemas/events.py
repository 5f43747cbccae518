"""The events of a request's life: frozen msgspec Structs, JSON on the bus, tagged by `type`.

Every event names a past fact. Every event carries `request_id`, `tenant` once known, `ts_ns`
(wall clock at publish) and `service_ns` (the publishing stage's own time on its monotonic
clock). New fields get defaults; a field's type never changes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from schemas.bounded import decode_bounded
from schemas.subjects import REQUEST_ID_PATTERN

RequestId = Annotated[str, Meta(pattern=REQUEST_ID_PATTERN)]
Priority = Literal["interactive", "batch"]
Truncation = Literal["drop_oldest", "sliding_window", "summarize"]
Role = Literal["system", "user", "assistant"]

MAX_TEXT_CHARS = 1_000_000  # one message, document or prompt
MAX_MESSAGES = 1024
MAX_DOCUMENTS = 64
MAX_PROMPT_TOKENS = 1 << 20  # a prompt given as token ids
# No model's vocabulary is larger: the wire's bound on a token id. The tokenize stage checks
# the served model's own (SmolLM2: 49152); the gateway knows no model.
VOCAB_CEILING = 1 << 20
TokenId = Annotated[int, Meta(ge=0, lt=VOCAB_CEILING)]
TopK = Annotated[int, Meta(ge=1, le=VOCAB_CEILING)]
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
# token id -> a bias added to its logit (JSON keys are the ids as text, as OpenAI sends them)
LogitBias = Annotated[
    dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)
]


class Message(Struct, frozen=True, forbid_unknown_fields=True):
    role: Role
    content: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]


class Document(Struct, frozen=True, kw_only=True, omit_defaults=True):
    content: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
    id: str | None = None
    title: str | None = None


MAX_CONSTRAINT_CHARS = 100_000  # a regex or grammar
MAX_CHOICES = 256


class JsonSchemaFormat(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """OpenAI's response_format.json_schema: the schema the output must validate against."""

    name: Annotated[str, Meta(min_length=1, max_length=64)] = "response"
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # enforced either way
    description: str | None = None


class ResponseFormat(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


ChoiceList = Annotated[
    list[Annotated[str, Meta(min_length=1, max_length=1024)]],
    Meta(min_length=1, max_length=MAX_CHOICES),
]
ConstraintText = Annotated[str, Meta(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
MAX_DEADLINE_S = 86_400.0  # a day: the longest a request may wait for its first token
DeadlineS = Annotated[float, Meta(gt=0.0, le=MAX_DEADLINE_S)]
EdgeWorker = Annotated[str, Meta(pattern=REQUEST_ID_PATTERN)]  # one subject token


class Sampling(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling parameters on the wire; the engine stage turns them into engine.SamplingParams."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] = 256
    min_tokens: Annotated[int, Meta(ge=0, le=8192)] = 0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)
    ] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = []
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # top-n per prompt token
    logit_bias: LogitBias | None = None
    # parallel sampling (n > 1): a request of the same prompt whose prompt K/V the engine shares
    # with this one once computed (the text is the same without it)
    fork_of: RequestId | None = None
    # structured output, at most one (the gateway checks): OpenAI's response_format, or vLLM's
    # guided_json (a schema, as an object or its JSON text), guided_regex, guided_choice (the
    # output is one of the strings), guided_grammar (Lark or GBNF)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: ConstraintText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: ConstraintText | None = None


CollectionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(?!\n)$")]


class Retrieval(Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Retrieval-augmented context: the tenant's collections to search for this request."""

    collections: Annotated[list[CollectionName], Meta(min_length=1, max_length=8)]
    top_k: Annotated[int, Meta(ge=1, le=64)] = 5  # chunks kept at most
    over_retrieve: Annotated[int, Meta(ge=1, le=16)] | None = None  # candidates = top_k x this
    rerank: bool = True  # rerank the candidates with the served model
    query: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None  # None: last message


class Submit(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a client publishes to `llm.in` (flat, OpenAI-style sampling fields).

    Exactly one of `messages` or `prompt`. The API key travels in the Brigade-Api-Key header
    (schemas.subjects.API_KEY_HEADER), not here; `api_key` is read from older clients. The
    gateway hashes it; the key itself is never stored.
    """

    request_id: RequestId | None = None
    api_key: str | None = None
    model: str | None = None
    messages: Annotated[list[Message], Meta(max_length=MAX_MESSAGES)] | None = None
    prompt: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)] | None = None
    # a raw prompt given as the served model's token ids (instead of `prompt`), passed as is
    prompt_token_ids: (
        Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)] | None
    ) = None
    system: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)] | None = None
    documents: Annotated[list[Document], Meta(max_length=MAX_DOCUMENTS)] = []
    truncation: Truncation = "drop_oldest"
    retrieval: Retrieval | None = None
    priority: Priority | None = None
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] = 256
    min_tokens: Annotated[int, Meta(ge=0, le=8192)] = 0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)
    ] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = []
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # top-n per prompt token
    logit_bias: LogitBias | None = None
    # parallel sampling (n > 1): a request of the same prompt whose prompt K/V the engine shares
    # with this one once computed (the text is the same without it)
    fork_of: RequestId | None = None
    # structured output, at most one (the gateway checks): OpenAI's response_format, or vLLM's
    # guided_json (a schema, as an object or its JSON text), guided_regex, guided_choice (the
    # output is one of the strings), guided_grammar (Lark or GBNF)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: ConstraintText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: ConstraintText | None = None
    # How long the request may wait for its first token (an engine to run it) before it is
    # cancelled: the edge's X-Brigade-Deadline-S or `deadline_s`, else the tenant's, else
    # BRIGADE_EDGE_DEADLINE_S. The sweeper leaves a run without tokens alone until then.
    deadline_s: DeadlineS | None = None
    # The edge worker following the run for its client (set by the edge, never by a client):
    # the sweeper cancels the run once that worker is gone, and its client's connection with it.
    edge_worker: EdgeWorker | None = None


class SubmitReply(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The gateway's answer to a submit that named a reply inbox (header Brigade-Reply-To)."""

    request_id: str
    accepted: bool
    code: str | None = None  # as RequestFailed.code when not accepted
    message: str | None = None
    field: str | None = None


class Request(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A validated submit, normalized: what travels from the gateway to the tokenizer."""

    messages: list[Message]  # the conversation; a bare `prompt` becomes one user message
    raw_prompt: bool = False  # True: `prompt` was given; tokenize it without the chat template
    prompt_token_ids: list[int] | None = None  # raw_prompt given as token ids (messages: none)
    system: str | None = None
    documents: list[Document] = []
    model: str | None = None
    truncation: Truncation = "drop_oldest"
    retrieval: Retrieval | None = None
    priority: Priority | None = None
    idempotency_key: str | None = None
    sampling: Sampling = Sampling()
    deadline_s: float | None = None  # as on the submit
    edge_worker: str | None = None  # as on the submit


class Usage(Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class ContextPart(Struct, frozen=True, kw_only=True):
    name: str  # "system" | "history" | "documents" | "user" | "summary"
    num_tokens: int  # tokens kept
    num_dropped_tokens: int = 0
    num_dropped_items: int = 0  # whole messages or documents dropped


class RetrievedChunk(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One retrieval candidate: its scores (None: that retriever did not rank it) and fate."""

    chunk_id: str
    collection: str
    source: str
    num_tokens: int
    fused_score: float
    vector_score: float | None = None  # cosine similarity
    keyword_score: float | None = None  # BM25
    rerank_score: float | None = None  # log P(yes) - log P(no) of the served model
    kept: bool = False
    reason: Literal["kept", "rank", "budget"] = "kept"  # rank: below top_k; budget: no room


class RetrievalTrace(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What retrieval did for one request (on `assembled`)."""

    collections: list[str]
    num_candidates: int = 0
    num_kept: int = 0
    num_tokens: int = 0  # prompt tokens of the retrieved part
    search_ns: int = 0  # embedding the query, vector and keyword search, fusion
    rerank_ns: int = 0
    rerank_fallback: str | None = None  # why the candidates kept their fused order
    chunks: list[RetrievedChunk] = []


class TokenLogprob(Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class Event(Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    request_id: str
    tenant: str | None = None
    ts_ns: int = 0
    service_ns: int = 0


class RequestAccepted(Event, tag="accepted"):
    request: Request
    key_hash: str | None = None  # "sha256:<hex>" of the API key; the key itself is never stored
    received_ns: int = 0  # wall clock when the gateway received the submit


class RequestAuthorized(Event, tag="authorized"):
    request: Request
    priority: Priority = "interactive"


class ContextAssembled(Event, tag="assembled"):
    request: Request  # messages now fitted to the context window
    priority: Priority = "interactive"
    parts: list[ContextPart] = []
    num_prompt_tokens: int = 0
    max_prompt_tokens: int = 0  # context window minus the output reserve
    truncated: bool = False
    fallback: str | None = None  # why `summarize` fell back to dropping without a summary
    retrieval: RetrievalTrace | None = None


class PromptTokenized(Event, tag="tokenized"):
    """Routed by `model`: stored on llm.ev.<request_id>.tokenized.<model token>, which only that
    model's engine workers consume (schemas/subjects.py ROUTED_EVENTS)."""

    prompt_token_ids: list[int]
    sampling: Sampling = Sampling()
    priority: Priority = "interactive"
    model: str | None = None  # the served model's id (the gateway resolved it)


class TokensGenerated(Event, tag="tokens"):
    """New token ids of one engine step, or of several while detokenize lags when the engine stage
    coalesces them (BRIGADE_STREAM_MAX_COALESCE > 1: stages/engine_stream.py). `seq` counts
    from 0 per request, one per event.

    `context_token_ids` are the tokens just before `token_ids` (enough to decode them and to
    hold back a stop string), so any detokenize worker can handle any event on its own.
    """

    seq: int
    token_ids: list[int]
    context_token_ids: list[int] = []
    stop: list[str] = []
    logprobs: list[list[TokenLogprob]] | None = None  # per token: the sampled one first, then top-n
    # seq 0 of a request with prompt_logprobs: per prompt token after the first, that token
    # first, then the top-n at the position before it
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    # Engine gauges after this step (the report's queue depth and KV usage; None when unknown).
    num_waiting: int | None = None  # requests waiting for admission into the engine
    num_running: int | None = None  # requests in the running batch
    kv_usage: float | None = None  # fraction of KV cache blocks in use, 0.0 to 1.0
    # the first tokens event of an engine step: the tokens that step computed (prefill and decode)
    num_step_tokens: int | None = None
    model: str | None = None  # the served model's id (its tokenizer decodes these ids)
    # tokens per second of step time an added token costs the engine, fitted over its recent
    # steps (stages/engine_rate.py): the rate a waiting prompt is computed at (edge admission)
    compute_tok_s: float | None = None


class RunStarted(Event, tag="started"):
    """The engine sent a request's first token: the run streams from here. Published once a run,
    just before its first `tokens` event, so what follows runs rather than tokens (the run-state
    projection's `streaming`, the edge's admission and gauges) reads one event a run instead of
    every delta."""

    model: str | None = None  # the served model's id
    # the engine's gauges after the step that sent the first token, as on `tokens`: an edge
    # reads them here and on `finished`, not on each step's `tokens`
    num_waiting: int | None = None
    num_running: int | None = None
    kv_usage: float | None = None
    compute_tok_s: float | None = None


class RunFinished(Event, tag="finished"):
    """The engine stopped generating for this request (eos, stop id, length or abort)."""

    finish_reason: Literal["stop", "length", "abort"]
    usage: Usage = Usage()
    last_seq: int | None = None  # seq of the last `tokens` event, None when none was published
    context_token_ids: list[int] = []  # the request's last tokens, for detokenize's final flush
    stop: list[str] = []
    seed: int | None = None
    queue_ns: int = 0  # waiting for admission into the engine
    prefill_ns: int = 0  # admission to first token
    decode_ns: int = 0  # first token to finish
    cancel_reason: str | None = None  # finish_reason "abort": the reason of the cancel event
    num_preemptions: int = 0  # times the engine preempted this run (its K/V computed again)
    num_waiting: int | None = None  # engine gauges when this run finished, as on `tokens`
    num_running: int | None = None
    kv_usage: float | None = None
    model: str | None = None  # the served model's id, as on `tokens`
    compute_tok_s: float | None = None  # as on `tokens`


class TextGenerated(Event, tag="text"):
    """A text delta; `seq` matches the `tokens` event it came from (the final flush is last_seq+1)."""

    seq: int
    text: str
    stopped: bool = False  # a stop string ended generation within this delta


class CancelRequested(Event, tag="cancel"):
    reason: Literal["client", "disconnect", "stop_string", "timeout"] = "client"
    seq: int | None = None  # stop_string: the `tokens` seq whose text completed the stop string


class RunCompleted(Event, tag="completed"):
    """The run's text is final: the last `text` event has seq `last_seq`."""

    finish_reason: Literal["stop", "length"]
    usage: Usage = Usage()
    last_seq: int = 0
    seed: int | None = None


class RunCancelled(Event, tag="cancelled"):
    reason: str = "client"
    usage: Usage = Usage()
    last_seq: int | None = None
    stage: str | None = None  # the stage that ended it before the engine did (None: detokenize)


class RequestFailed(Event, tag="failed"):
    """Terminal: the request could not be served. `field` names the offending input, if any."""

    stage: str
    code: Literal[
        "invalid_request",
        "unauthorized",
        "forbidden",
        "rate_limited",
        "overloaded",
        "conflict",
        "context_length",
        "model_not_found",  # a model no engine of this deployment serves (BRIGADE_MODEL)
        "internal",
    ]
    message: str
    field: str | None = None
    retry_after_s: float | None = None
    usage: Usage = Usage()


class DocumentSubmitted(Event, tag="doc_submitted"):
    """A document for a tenant's collection (the ingest service's input); `request_id` names
    this ingestion, not a run. The collection is created if the tenant has none of that name."""

    collection: CollectionName
    source: Annotated[str, Meta(min_length=1, max_length=1024)]
    text: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]


class DocumentAdded(Event, tag="doc_added"):
    """The ingest service stored the document (`added` False: the same text was there)."""

    collection: str
    doc_id: str
    source: str
    content_hash: str
    num_chunks: int
    num_chars: int
    added: bool = True


class DocumentRejected(Event, tag="doc_rejected"):
    """The document could not be ingested; `message` says why and what to change."""

    collection: str
    source: str
    code: str
    message: str
    field: str | None = None


class DocumentDeleted(Event, tag="doc_deleted"):
    collection: str
    doc_id: str


class CollectionDeleted(Event, tag="collection_deleted"):
    collection: str


class RunBilled(Event, tag="billed"):
    status: Literal["completed", "cancelled", "failed"]
    usage: Usage = Usage()
    billing_key: str = ""


AnyEvent = (
    RequestAccepted
    | RequestAuthorized
    | ContextAssembled
    | PromptTokenized
    | RunStarted
    | TokensGenerated
    | RunFinished
    | TextGenerated
    | CancelRequested
    | RunCompleted
    | RunCancelled
    | RequestFailed
    | RunBilled
    | DocumentSubmitted
    | DocumentAdded
    | DocumentRejected
    | DocumentDeleted
    | CollectionDeleted
)

EVENT_TYPES: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in AnyEvent.__args__  # type: ignore[attr-defined]
}
TERMINAL_EVENTS = ("completed", "cancelled", "failed")

_encoder = msgspec.json.Encoder()
_any_decoder = msgspec.json.Decoder(AnyEvent)
_submit_decoder = msgspec.json.Decoder(Submit)


def encode(event: Event | Submit) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> AnyEvent:
    """Any event; raises msgspec.ValidationError naming the field on bad input (too deep too)."""
    return decode_bounded(_any_decoder, data)


def decode_submit(data: bytes) -> Submit:
    return decode_bounded(_submit_decoder, data)


def decoder_for(*types: type[Event]) -> msgspec.json.Decoder:
    """A typed decoder for the events one consumer expects (tagged union when several)."""
    if len(types) == 1:
        return msgspec.json.Decoder(types[0])
    from functools import reduce
    from operator import or_

    return msgspec.json.Decoder(reduce(or_, types))
