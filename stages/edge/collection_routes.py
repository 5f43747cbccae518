"""A tenant's document collections over HTTP, in the shape of OpenAI's vector stores: a
collection is a `vector_store` whose id is its name, a document a `vector_store.file`.

    POST   /v1/vector_stores                      {"name"}: create (an existing one is returned)
    GET    /v1/vector_stores                      the caller's collections
    GET    /v1/vector_stores/{name}
    DELETE /v1/vector_stores/{name}
    POST   /v1/vector_stores/{name}/files         {"text", "source"}: add through the ingest service
    GET    /v1/vector_stores/{name}/files
    DELETE /v1/vector_stores/{name}/files/{id}

Every route acts on the caller's tenant only: another tenant's collection answers exactly like
one that does not exist (404). Adding publishes `doc_submitted` and waits (up to `wait_s`) for
the ingest service's answer; the document's id is known at once (its content hash), so a slow
ingestion answers `in_progress` and the list shows the document once it is stored.
"""

from __future__ import annotations

from typing import Annotated

import anyio
import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from schemas import subjects
from schemas.events import (
    MAX_TEXT_CHARS,
    CollectionDeleted,
    DocumentAdded,
    DocumentDeleted,
    DocumentRejected,
    DocumentSubmitted,
    decode_event,
)
from stages.edge.core import Edge
from stages.edge.errors import RequestError, bus_error, error_response
from stages.retrieval.store import (
    CollectionInfo,
    CollectionNotFound,
    DocumentInfo,
    Store,
    content_hash,
    default_path,
    document_id,
)
from stages.runtime.failures import StageError


class CreateStore(Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class AddFile(Struct, frozen=True, forbid_unknown_fields=True):
    text: Annotated[str, Meta(min_length=1, max_length=MAX_TEXT_CHARS)]
    source: Annotated[str, Meta(min_length=1, max_length=1024)] = "document.txt"


def store_body(c: CollectionInfo) -> dict:
    return {
        "id": c.name,
        "object": "vector_store",
        "name": c.name,
        "created_at": c.created_ns // 1_000_000_000,
        "status": "completed",
        "file_counts": {"completed": c.num_documents, "total": c.num_documents},
        "num_chunks": c.num_chunks,
    }


def file_body(d: DocumentInfo) -> dict:
    return {
        "id": d.doc_id,
        "object": "vector_store.file",
        "vector_store_id": d.collection,
        "status": "completed",
        "created_at": d.added_ns // 1_000_000_000,
        "usage_bytes": d.num_chars,
        "source": d.source,
        "num_chunks": d.num_chunks,
        "content_hash": d.content_hash,
    }


def _decode(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as err:
        raise RequestError("invalid_request", str(err)) from None
    except msgspec.DecodeError:
        raise RequestError("invalid_request", "the body is not JSON") from None


def _as_request_error(err: StageError) -> RequestError:
    if isinstance(err, CollectionNotFound):
        return RequestError("not_found", str(err), "vector_store_id")
    return RequestError("invalid_request", str(err), err.field)


class CollectionRoutes:
    def __init__(self, edge: Edge, *, wait_s: float = 60.0) -> None:
        self.edge = edge
        self.wait_s = wait_s
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(default_path())
        return self._store

    async def _call(self, request: Request, work) -> Response:
        try:
            caller = self.edge.authenticate(request)
            return await work(caller.tenant)
        except StageError as err:
            return error_response(_as_request_error(err))
        except RequestError as err:
            return error_response(err)

    async def create(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            body = _decode(await request.body(), CreateStore)
            info, _ = self.store.create_collection(tenant, body.name)
            return JSONResponse(store_body(info))

        return await self._call(request, work)

    async def list(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            data = [store_body(c) for c in self.store.list_collections(tenant)]
            return JSONResponse({"object": "list", "data": data, "has_more": False})

        return await self._call(request, work)

    async def get(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            name = request.path_params["name"]
            return JSONResponse(store_body(self.store.get_collection(tenant, name)))

        return await self._call(request, work)

    async def delete(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            name = request.path_params["name"]
            self.store.delete_collection(tenant, name)
            await self._log(CollectionDeleted(request_id=_log_id(), tenant=tenant, collection=name))
            return JSONResponse({"id": name, "object": "vector_store.deleted", "deleted": True})

        return await self._call(request, work)

    async def list_files(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            name = request.path_params["name"]
            data = [file_body(d) for d in self.store.list_documents(tenant, name)]
            return JSONResponse({"object": "list", "data": data, "has_more": False})

        return await self._call(request, work)

    async def delete_file(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            name, doc_id = request.path_params["name"], request.path_params["doc_id"]
            if not self.store.delete_document(tenant, name, doc_id):
                raise RequestError("not_found", f"no file {doc_id[:80]!r} in {name!r}", "file_id")
            event = DocumentDeleted(
                request_id=_log_id(), tenant=tenant, collection=name, doc_id=doc_id
            )
            await self._log(event)
            return JSONResponse({"id": doc_id, "object": "vector_store.file.deleted", "deleted": True})  # fmt: skip

        return await self._call(request, work)

    async def add_file(self, request: Request) -> Response:
        async def work(tenant: str) -> Response:
            name = request.path_params["name"]
            body = _decode(await request.body(), AddFile)
            self.store.get_collection(tenant, name)  # 404 before anything is published
            return JSONResponse(await self._ingest(tenant, name, body))

        return await self._call(request, work)

    async def _ingest(self, tenant: str, name: str, body: AddFile) -> dict:
        rid = _log_id()
        bus = self.edge.bus
        outcome: list = []
        done = anyio.Event()

        async def on_msg(msg) -> None:
            event = decode_event(msg.data)
            if isinstance(event, DocumentAdded | DocumentRejected) and not outcome:
                outcome.append(event)
                done.set()

        try:
            sub = await bus.nc.subscribe(subjects.request_events(rid), cb=on_msg)
            try:
                await bus.publish(
                    DocumentSubmitted(
                        request_id=rid, tenant=tenant, collection=name, source=body.source,
                        text=body.text,
                    )
                )  # fmt: skip
                with anyio.move_on_after(self.wait_s):
                    await done.wait()
            finally:
                await sub.unsubscribe()
        except Exception as exc:  # noqa: BLE001 - NATS trouble becomes the edge's 503
            mapped = bus_error(exc)
            if mapped is None:
                raise
            raise mapped from exc
        doc_id = document_id(tenant, name, content_hash(body.text))
        base = {"id": doc_id, "object": "vector_store.file", "vector_store_id": name}
        if not outcome:
            return base | {"status": "in_progress", "source": body.source}
        event = outcome[0]
        if isinstance(event, DocumentRejected):
            error = {"code": event.code, "message": event.message}
            return base | {"status": "failed", "source": body.source, "last_error": error}
        docs = {d.doc_id: d for d in self.store.list_documents(tenant, name)}
        return file_body(docs[event.doc_id]) | {"already_present": not event.added}

    async def _log(self, event) -> None:
        try:
            await self.edge.bus.publish(event)
        except Exception as exc:  # noqa: BLE001
            mapped = bus_error(exc)
            if mapped is None:
                raise
            raise mapped from exc


def _log_id() -> str:
    import secrets

    return "ing-" + secrets.token_hex(12)
