"""The served model's routes, as vLLM answers them: GET /v1/models and /v1/models/{id} (with
`max_model_len`), GET /health (200 only while an engine worker serves; with each stage's live
and ready workers and the engine's KV room, from their heartbeats), GET /version, and POST
/tokenize and /detokenize with the served tokenizer and chat template, exactly as the
tokenize stage encodes a prompt (no special tokens added; the template writes its own).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import anyio
import msgspec
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.tokenizer import Tokenizer
from schemas import subjects
from stages.edge.core import Edge
from stages.edge.errors import RequestError, error_response
from stages.edge.openai_messages import ChatMessage, validate_messages, wire_messages
from stages.edge.openai_routes import read_body
from stages.edge.openai_schema import decode_json, param_of
from stages.edge.tool_calls import Tools
from stages.runtime import heartbeat

MAX_DETOKENIZE_IDS = 1 << 17


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

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.edge.tokenizer is not None, "the edge was not started"
        return self.edge.tokenizer

    def _card(self, name: str) -> dict[str, Any]:
        model = self.edge.config.model
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "brigade",
            "root": model,
            "parent": None if name == model else model,
            "max_model_len": self.edge.max_model_len,
        }

    def _names(self, request: Request) -> list[str]:
        caller = self.edge.authenticate(request)
        config = self.edge.config
        return caller.models((config.model, *config.model_aliases))

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [self._card(n) for n in self._names(request)]}
        )

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self._names(request):
            raise RequestError(
                "model_not_found", f"the model {name[:100]!r} is not served here", "model"
            )
        return JSONResponse(self._card(name))

    async def health(self, request: Request) -> Response:
        ready, detail = await self.edge.engine_ready()
        if ready:
            body: dict[str, Any] = {"status": "ok", "detail": detail}
            stages = await self._stages()
            if stages is not None:
                body["stages"] = stages
                body["engine"] = stages.get("engine", {}).get("detail", [])
            return JSONResponse(body)
        err = RequestError("unavailable", f"not ready to serve: {detail}", retry_after_s=1.0)
        return error_response(err)

    async def _stages(self) -> dict[str, Any] | None:
        """Each stage's live and ready workers from their heartbeats (None: cannot read them)."""
        try:
            with anyio.fail_after(2.0):
                kv = await self.edge.bus.kv(subjects.STAGES_BUCKET, ttl_s=heartbeat.TTL_S)
                return heartbeat.by_stage(await heartbeat.beats(kv, timeout_s=1.0))
        except Exception:  # noqa: BLE001 - readiness is answered without the per-stage detail
            return None

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": brigade_version()})

    async def tokenize(self, request: Request) -> Response:
        caller = self.edge.authenticate(request)
        raw = decode_json(await read_body(request, self.edge.config.max_body_bytes))
        chat = isinstance(raw, dict) and "messages" in raw
        req = _convert(raw, TokenizeChat if chat else TokenizeCompletion)
        self.edge.served_model(caller, req.model)
        tok = self.tokenizer
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
                "max_model_len": self.edge.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        caller = self.edge.authenticate(request)
        raw = decode_json(await read_body(request, self.edge.config.max_body_bytes))
        req = _convert(raw, Detokenize)
        self.edge.served_model(caller, req.model)
        vocab = self.tokenizer.vocab_size
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
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})
