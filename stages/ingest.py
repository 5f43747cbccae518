"""Ingest: `doc_submitted` -> `doc_added` (or `doc_rejected`): chunk, embed and store one document
in its tenant's collection (stages/retrieval). More workers share the durable; a redelivered or
replayed document is found by its content hash and stored once.

The embedding model (torch) loads in setup, off the event loop; embedding runs in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from engine.tokenizer import Tokenizer
from schemas import settings
from schemas.events import DocumentAdded, DocumentRejected, DocumentSubmitted, Event, decoder_for
from stages.retrieval.ingest import Chunking, Embed, add_text
from stages.retrieval.store import Store, check_name, default_path
from stages.runtime.failures import StageError
from stages.runtime.spec import StageContext, StageSpec
from stages.tokenize import served_model, tokenizer_for

STAGE = "ingest"


@dataclass
class IngestState:
    store: Store
    embed: Embed
    tok: Tokenizer  # the served model's: chunks are measured in its tokens
    chunking: Chunking


async def handle(event: DocumentSubmitted, state: IngestState) -> list[Event]:
    tenant = event.tenant
    try:
        if not tenant:
            raise StageError("invalid_request", "a document needs its tenant", field="tenant")
        check_name(event.collection)
        state.store.create_collection(tenant, event.collection)
        doc, added = await anyio.to_thread.run_sync(
            lambda: add_text(
                state.store,
                state.embed,
                state.tok,
                state.chunking,
                tenant=tenant,
                collection=event.collection,
                source=event.source,
                text=event.text,
            )
        )
    except StageError as err:
        return [
            DocumentRejected(
                request_id=event.request_id,
                tenant=tenant,
                collection=event.collection,
                source=event.source,
                code=err.code,
                message=str(err),
                field=err.field,
            )
        ]
    return [
        DocumentAdded(
            request_id=event.request_id,
            tenant=tenant,
            collection=doc.collection,
            doc_id=doc.doc_id,
            source=doc.source,
            content_hash=doc.content_hash,
            num_chunks=doc.num_chunks,
            num_chars=doc.num_chars,
            added=added,
        )
    ]


def load_embed() -> Embed:
    from engine.embedding import Embedder

    return Embedder().embed


async def setup(ctx: StageContext) -> IngestState:
    embed = await anyio.to_thread.run_sync(load_embed)
    return IngestState(
        store=Store(default_path()),
        embed=embed,
        tok=tokenizer_for(served_model()),
        chunking=Chunking(
            max_tokens=settings.CHUNK_TOKENS.get(), overlap=settings.CHUNK_OVERLAP.get()
        ),
    )


SPEC = StageSpec(
    name=STAGE,
    input_event="doc_submitted",
    decoder=decoder_for(DocumentSubmitted),
    handle=handle,
    setup=setup,
    ack_wait_s=120.0,  # a long document embeds for a while
    max_in_flight=4,
)
