"""Tokenize: `assembled` -> `tokenized`. The chat template renders the fitted messages (control
tokens only from its framing: content is data); a raw `prompt` is encoded as is. Uses only
engine.tokenizer (no torch), so the stage starts fast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from engine.tokenizer import Tokenizer, load_tokenizer
from schemas import models
from schemas.events import (
    ContextAssembled,
    Event,
    PromptTokenized,
    Request,
    decoder_for,
)
from stages.runtime.failures import StageError
from stages.runtime.spec import StageContext, StageSpec

STAGE = "tokenize"


Tokenizers = Callable[[str | None], Tokenizer]  # a served model's id (None: the default) -> its


@functools.cache
def tokenizer_for(model: str) -> Tokenizer:
    """The tokenizer and chat template of an artifact (a registered name, .gguf or HF dir)."""
    return load_tokenizer(model)


def served_model() -> str:
    """The default served model's artifact (BRIGADE_MODEL's first)."""
    return models.default().artifact


def model_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of the served model of id `model` (None: the default), loaded once: the
    one its engine workers load from the same artifact. A model not served fails the request
    (the gateway refuses those first)."""
    served = models.served()
    found = models.find(served, model)
    if found is None:
        raise StageError("model_not_found", models.not_served(model, served), field="model")
    return tokenizer_for(found.artifact)


def prompt_token_ids(request: Request, tokenizer: Tokenizer) -> list[int]:
    """The prompt's ids. Messages (user, assistant, system, documents, summaries) go through the
    chat template, and control-token text in their content is encoded as ordinary text, so no
    content can forge a turn. A raw `prompt` (the completions API) is the caller's whole text,
    framing included: as in vLLM, control-token text there is the control token."""
    if request.prompt_token_ids is not None:  # given as ids: the caller's own tokens
        return list(request.prompt_token_ids)
    if request.raw_prompt:
        return tokenizer.encode(request.messages[0].content)
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    return tokenizer.encode_chat(messages, add_generation_prompt=True)


def check_token_ids(request: Request, tokenizer: Tokenizer) -> None:
    """Token ids the client named must be the model's: the wire only bounds them by any model."""
    sampling = request.sampling
    named = [(f"prompt_token_ids[{i}]", t) for i, t in enumerate(request.prompt_token_ids or ())]
    named += [(f"stop_token_ids[{i}]", t) for i, t in enumerate(sampling.stop_token_ids)]
    named += [(f"logit_bias.{t}", t) for t in sampling.logit_bias or {}]
    for field, token_id in named:
        if token_id >= tokenizer.vocab_size:
            raise StageError(
                "invalid_request",
                f"{field}: {token_id} is not a token of {tokenizer.model_name}: its ids are 0 "
                f"to {tokenizer.vocab_size - 1}",
                field=field,
            )


def handle(event: ContextAssembled, tokenizers: Tokenizers) -> list[Event]:
    """The request's model's template and ids; the event names that model, so it is routed to
    that model's engine workers."""
    tokenizer = tokenizers(event.request.model)
    check_token_ids(event.request, tokenizer)
    ids = prompt_token_ids(event.request, tokenizer)
    if not ids:
        raise StageError("invalid_request", "the prompt has no tokens", field="prompt")
    if event.max_prompt_tokens and len(ids) > event.max_prompt_tokens:
        raise StageError(
            "context_length",
            f"the prompt has {len(ids)} tokens but only {event.max_prompt_tokens} fit (the "
            f"context window minus max_tokens={event.request.sampling.max_tokens}); shorten "
            "the input, lower max_tokens or choose a truncation strategy",
            field="messages",
        )
    return [
        PromptTokenized(
            request_id=event.request_id,
            tenant=event.tenant,
            prompt_token_ids=ids,
            sampling=event.request.sampling,
            priority=event.priority,
            model=event.request.model or models.default().id,
        )
    ]


async def setup(ctx: StageContext) -> Tokenizers:
    for model in models.served():  # each served model's tokenizer ready before the first input
        tokenizer_for(model.artifact)
    return model_tokenizer


SPEC = StageSpec(
    name=STAGE,
    input_event="assembled",
    decoder=decoder_for(ContextAssembled),
    handle=handle,
    setup=setup,
)
