"""The served models' routes, as vLLM answers them: GET /v1/models and /v1/models/{id} (each
served model and alias with `max_model_len`, and what its live engine workers announce), GET
/health (200 only while every served model has an engine worker serving; with each stage's
live and ready workers, each model's announcement and the engines' KV room, from their
heartbeats), GET /version, and POST /tokenize and /detokenize with the named model's tokenizer
and chat template, exactly as the tokenize stage encodes a prompt (no special tokens added; the
template writes its own).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stages.edge.core import Edge
from stages.edge.errors import RequestError, error_response
from stages.edge.openai_messages import ChatMessage, validate_messages, wire_messages
from stages.edge.openai_routes import read_body
from stages.edge.openai_schema import decode_json, param_of
from stages.edge.tool_calls import Tools
from stages.runtime import heartbeat

MAX_DETOKENIZE_IDS = 1 << 17
# what a model card shows of an engine worker's announcement (stages/engine.py announcement)
ANNOUNCED = ("artifact", "format", "dtype", "quantization", "max_model_len", "tokenizer")


def brigade_version() -> str:
    try:
        return importlib.metadata.version("brigade")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class TokenizeCompletion(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True  # the served tokenizer adds none either way (as the pipeline)
    return_token_strs: bool = False


class TokenizeChat(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    tools: Tools | None = None  # rendered into the system prompt, as for a chat request
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


def _convert(raw: Any, kind: type[Struct]) -> Any:
    if isinstance(raw, dict) and kind is TokenizeChat and "messages" in raw:
        raw = {**raw, "messages": validate_messages(raw["messages"])}
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as err:
        param = param_of(err)
        raise RequestError(
            "invalid_request", f"invalid `{param or 'body'}`: {err}", param
        ) from None


class ModelRoutes:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    def _card(self, name: str, announced: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        """One model (or alias) as OpenAI's model object, vLLM's `max_model_len` added (the
        engine's own, once one announces it) and `engines`: what each live, ready engine
        worker of it announces (artifact, format, dtype, quantization, tokenizer)."""
        model = name if name in self.edge.tokenizers else self.edge.config.aliases().get(name, name)
        artifact = next((m.artifact for m in self.edge.config.served if m.id == model), model)
        engines = announced.get(model, [])
        lens = [e["max_model_len"] for e in engines if isinstance(e.get("max_model_len"), int)]
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "brigade",
            "root": artifact,
            "parent": None if name == model else model,
            "max_model_len": min(lens) if lens else self.edge.model_len(model),
            "engines": engines,
        }

    def _names(self, request: Request) -> list[str]:
        caller = self.edge.authenticate(request)
        ids = [m.id for m in self.edge.config.served]
        aliases = [a for a, target in self.edge.config.aliases().items() if target in ids]
        return caller.models((*ids, *aliases))

    async def _announced(self) -> dict[str, list[dict[str, Any]]]:
        """model id -> the announcements of its live, ready engine workers."""
        found: dict[str, list[dict[str, Any]]] = {}
        for beat in await self.edge.beats() or ():
            model = beat.detail.get("model")
            if beat.stage == "engine" and beat.ready and isinstance(model, str):
                keep = {k: v for k, v in beat.detail.items() if k in ANNOUNCED}
                found.setdefault(model, []).append({"worker": beat.worker, **keep})
        return found

    async def models(self, request: Request) -> Response:
        names = self._names(request)
        announced = await self._announced()
        return JSONResponse({"object": "list", "data": [self._card(n, announced) for n in names]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self._names(request):
            raise RequestError(
                "model_not_found", f"the model {name[:100]!r} is not served here", "model"
            )
        return JSONResponse(self._card(name, await self._announced()))

    async def health(self, request: Request) -> Response:
        ready, detail = await self.edge.engine_ready()
        if ready:
            body: dict[str, Any] = {"status": "ok", "detail": detail}
            beats = await self.edge.beats()
            if beats is not None:
                stages = heartbeat.by_stage(beats)
                body["stages"] = stages
                body["engine"] = stages.get("engine", {}).get("detail", [])
            return JSONResponse(body)
        err = RequestError("unavailable", f"not ready to serve: {detail}", retry_after_s=1.0)
        return error_response(err)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": brigade_version()})

    async def tokenize(self, request: Request) -> Response:
        caller = self.edge.authenticate(request)
        raw = decode_json(await read_body(request, self.edge.config.max_body_bytes))
        chat = isinstance(raw, dict) and "messages" in raw
        req = _convert(raw, TokenizeChat if chat else TokenizeCompletion)
        model = self.edge.served_model(caller, req.model)
        tok = self.edge.tokenizer_of(model)
        if isinstance(req, TokenizeChat):
            messages = wire_messages(req.messages, req.tools)
            try:
                ids = tok.encode_chat(messages, add_generation_prompt=req.add_generation_prompt)
            except ValueError as err:
                raise RequestError("invalid_request", str(err), "messages") from None
        else:
            ids = tok.encode(req.prompt)
        strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.edge.model_len(model),
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        caller = self.edge.authenticate(request)
        raw = decode_json(await read_body(request, self.edge.config.max_body_bytes))
        req = _convert(raw, Detokenize)
        tok = self.edge.tokenizer_of(self.edge.served_model(caller, req.model))
        vocab = tok.vocab_size
        bad = [i for i, t in enumerate(req.tokens) if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                "invalid_request",
                f"tokens[{bad[0]}]={req.tokens[bad[0]]} is outside the vocabulary [0, {vocab})",
                f"tokens[{bad[0]}]",
            )
        if len(req.tokens) > MAX_DETOKENIZE_IDS:
            raise RequestError(
                "invalid_request",
                f"{len(req.tokens)} tokens; at most {MAX_DETOKENIZE_IDS} per request",
                "tokens",
            )
        return JSONResponse({"prompt": tok.decode(req.tokens)})
