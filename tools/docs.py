"""`brigade docs`: a tenant's document collections for retrieval.

`add TENANT COLLECTION FILES...` publishes each document (text, Markdown, JSON lines: a document
per record) as a `doc_submitted` event and waits for the ingest service's `doc_added` or
`doc_rejected`, with a progress bar; `list` and `delete` read and change the store
(BRIGADE_RETRIEVAL_DB), and a delete is logged as an event too.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("docs", help="a tenant's document collections for retrieval")
    sub = p.add_subparsers(dest="docs_command", metavar="ACTION")
    add = sub.add_parser("add", help="add documents to TENANT's COLLECTION (created if missing)")
    add.add_argument("tenant")
    add.add_argument("collection")
    add.add_argument("files", nargs="+", type=Path, help=".txt, .md, .jsonl (a document per line)")
    add.add_argument("--nats-url", help="NATS server URLs (default: NATS_URL, else `brigade up`'s)")
    add.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for ingestion")
    add.set_defaults(func=run)
    ls = sub.add_parser("list", help="TENANT's collections, or one collection's documents")
    ls.add_argument("tenant")
    ls.add_argument("collection", nargs="?")
    ls.set_defaults(func=run)
    rm = sub.add_parser("delete", help="delete a collection, or one document of it")
    rm.add_argument("tenant")
    rm.add_argument("collection")
    rm.add_argument("doc_id", nargs="?")
    rm.add_argument("--nats-url")
    rm.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])


def run(args) -> int:
    actions = {"add": run_add, "list": run_list, "delete": run_delete}
    return actions[args.docs_command](args)


def ingest_id() -> str:
    return "ing-" + secrets.token_hex(12)


def read_documents(files: list[Path]):
    """(source, text) per document of the files, in order; raises ValueError naming the file."""
    from stages.retrieval.ingest import format_of, parse

    found = []
    for path in files:
        try:
            data = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read it as UTF-8 text ({err})") from None
        found += [(d.source, d.text) for d in parse(path.name, data, format_of(path))]
    return found


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0

    def step(self, note: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        print(f"\r[{bar}] {self.done}/{self.total} {note[:50]:<50}", end="", file=sys.stderr)
        if self.done == self.total:
            print(file=sys.stderr)


async def add(args, config, documents) -> int:
    import anyio

    from schemas import subjects
    from schemas.events import (
        DocumentAdded,
        DocumentRejected,
        DocumentSubmitted,
        RequestFailed,
        decode_event,
    )
    from stages.runtime.bus import Bus

    bus = await Bus.connect(config, name="brigade-docs")
    ids = [ingest_id() for _ in documents]
    outcomes: dict[str, DocumentAdded | DocumentRejected | RequestFailed] = {}
    sources = {rid: source for rid, (source, _) in zip(ids, documents, strict=True)}
    progress = Progress(len(documents))
    done = anyio.Event()

    async def on_msg(msg) -> None:
        event = decode_event(msg.data)
        found = isinstance(event, DocumentAdded | DocumentRejected | RequestFailed)
        if found and event.request_id in sources:
            if event.request_id not in outcomes:
                outcomes[event.request_id] = event
                if isinstance(event, DocumentAdded):
                    note = f"{event.source}: {event.num_chunks} chunks" + ("" if event.added else " (already there)")  # fmt: skip
                elif isinstance(event, DocumentRejected):
                    note = f"{event.source}: rejected"
                else:
                    note = f"{sources[event.request_id]}: failed"
                progress.step(note)
            if len(outcomes) == len(ids):
                done.set()

    try:
        subs = [
            await bus.nc.subscribe(subjects.all_events(tag), cb=on_msg)
            for tag in ("doc_added", "doc_rejected", "failed")  # failed: the ingest stage's error
        ]
        await bus.nc.flush()
        for rid, (source, text) in zip(ids, documents, strict=True):
            await bus.publish(
                DocumentSubmitted(
                    request_id=rid,
                    tenant=args.tenant,
                    collection=args.collection,
                    source=source,
                    text=text,
                )
            )
        with anyio.move_on_after(args.timeout):
            await done.wait()
        for sub in subs:
            await sub.unsubscribe()
    finally:
        await bus.close()
    if len(outcomes) < len(ids):
        print(
            f"\nbrigade docs add: {len(ids) - len(outcomes)} of {len(ids)} documents were not "
            f"ingested within {args.timeout:g} s (--timeout); is the ingest service up? see "
            "`brigade status`",
            file=sys.stderr,
        )
        return 1
    rejected = [e for e in outcomes.values() if isinstance(e, DocumentRejected)]
    for e in rejected:
        print(f"brigade docs add: {e.source}: {e.message}", file=sys.stderr)
    failed = [e for e in outcomes.values() if isinstance(e, RequestFailed)]
    for e in failed:
        print(
            f"brigade docs add: {sources[e.request_id]}: failed ({e.code}): {e.message}",
            file=sys.stderr,
        )
    added = [e for e in outcomes.values() if isinstance(e, DocumentAdded)]
    print(
        f"{sum(e.added for e in added)} added, {sum(not e.added for e in added)} already there, "
        f"{len(rejected)} rejected, {len(failed)} failed; {sum(e.num_chunks for e in added)} "
        f"chunks in {args.tenant}/{args.collection}"
    )
    return 1 if rejected or failed else 0


def run_add(args) -> int:
    import anyio

    from stages.runtime.bus import BusConfig

    try:
        documents = read_documents(args.files)
        config = BusConfig.from_env(args.nats_url)
    except (RuntimeError, ValueError) as err:
        print(f"brigade docs add: {err}", file=sys.stderr)
        return 2
    if not documents:
        print("brigade docs add: the files hold no documents", file=sys.stderr)
        return 2
    return anyio.run(add, args, config, documents)


def run_list(args) -> int:
    from stages.retrieval.store import Store, default_path
    from stages.runtime.failures import StageError

    store = Store(default_path())
    try:
        if args.collection is None:
            for c in store.list_collections(args.tenant):
                print(f"{c.name}\t{c.num_documents} documents\t{c.num_chunks} chunks")
        else:
            for d in store.list_documents(args.tenant, args.collection):
                print(f"{d.doc_id}\t{d.num_chunks} chunks\t{d.num_chars} chars\t{d.source}")
    except StageError as err:
        print(f"brigade docs list: {err}", file=sys.stderr)
        return 1
    return 0


def run_delete(args) -> int:
    import anyio

    from schemas.events import CollectionDeleted, DocumentDeleted
    from stages.retrieval.store import Store, default_path
    from stages.runtime.bus import Bus, BusConfig
    from stages.runtime.failures import StageError

    store = Store(default_path())
    try:
        if args.doc_id is None:
            store.delete_collection(args.tenant, args.collection)
            event = CollectionDeleted(
                request_id=ingest_id(), tenant=args.tenant, collection=args.collection
            )
        else:
            if not store.delete_document(args.tenant, args.collection, args.doc_id):
                raise StageError("invalid_request", f"no document {args.doc_id!r} in {args.collection!r}")  # fmt: skip
            event = DocumentDeleted(
                request_id=ingest_id(),
                tenant=args.tenant,
                collection=args.collection,
                doc_id=args.doc_id,
            )
    except StageError as err:
        print(f"brigade docs delete: {err}", file=sys.stderr)
        return 1

    async def log() -> None:
        bus = await Bus.connect(BusConfig.from_env(args.nats_url), name="brigade-docs")
        try:
            await bus.publish(event)
        finally:
            await bus.close()

    try:
        anyio.run(log)
    except (RuntimeError, ValueError, OSError) as err:
        print(f"brigade docs delete: deleted, but not logged on the bus: {err}", file=sys.stderr)
    print("deleted")
    return 0
