"""NATS users for Brigade's services: one user per stage, allowed to publish and subscribe only
the subjects its work needs, and `admin` for operators' tools. Renders the server configuration
that compose runs (deploy/nats/brigade.conf); each password comes from the server's environment
(`NATS_PASSWORD_<USER>`), so the file holds no secret.

    python -m tools.nats_auth > deploy/nats/brigade.conf   # after a change here
    python -m tools.nats_auth --env > .env                 # passwords for compose, once
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass

from schemas import subjects

JS = "$JS.API"
# The runtime's dead letters (stages/runtime/deadletter.py): granted by name, so the file stays
# the same whether or not this version's runtime records them.
DEAD_STREAM, ALL_DEAD = "BRIGADE_DEAD", "llm.dead.>"
STREAMS = (subjects.EVENTS_STREAM, subjects.SUBMIT_STREAM, DEAD_STREAM)
EVERY_BUCKET = (
    subjects.IDEMPOTENCY_BUCKET,
    subjects.RUNS_BUCKET,
    subjects.RATES_BUCKET,
    subjects.REQUEST_IDS_BUCKET,
    subjects.STAGES_BUCKET,
)


def events(*tags: str) -> list[str]:
    return [subjects.all_events(tag) for tag in tags]


def bucket(name: str) -> list[str]:
    """Read, write and create one KV bucket (a stream KV_<name> over $KV.<name>.>)."""
    return [
        f"$KV.{name}.>",
        f"{JS}.DIRECT.GET.KV_{name}.>",
        f"{JS}.STREAM.INFO.KV_{name}",
        f"{JS}.STREAM.CREATE.KV_{name}",
        f"{JS}.STREAM.UPDATE.KV_{name}",
        f"{JS}.STREAM.MSG.GET.KV_{name}",
        f"{JS}.CONSUMER.*.KV_{name}.>",  # watches and key listings
    ]


# What every worker of the runtime does: set up Brigade's streams, KV buckets and its durable,
# pull and ack, read stored events by subject, beat into brigade_stages, record dead letters, and
# fail or end (cancelled) a request it cannot serve. Stream deletion is allowed for one stream only:
# the submit queue of an older data dir, recreated in memory (stages/runtime/bus.py).
RUNTIME_PUBLISH = [
    f"{JS}.INFO",
    *(f"{JS}.STREAM.{op}.{name}" for op in ("INFO", "CREATE", "UPDATE") for name in STREAMS),
    f"{JS}.STREAM.DELETE.{subjects.SUBMIT_STREAM}",
    # creating Brigade's KV buckets (Bus.ensure_kv) reads and writes none of them
    *(f"{JS}.STREAM.{op}.KV_{name}" for op in ("INFO", "CREATE") for name in EVERY_BUCKET),
    *(f"{JS}.STREAM.MSG.GET.{name}" for name in STREAMS),
    f"{JS}.DIRECT.GET.{subjects.EVENTS_STREAM}.>",
    f"{JS}.CONSUMER.>",  # durables, pulls and the replay's ephemeral consumer
    "$JS.ACK.>",
    ALL_DEAD,
    *events("failed", "cancelled"),
    *bucket(subjects.STAGES_BUCKET),
]
RUNTIME_SUBSCRIBE = [
    "_INBOX.>",  # request replies, pulled messages, publish acks
    subjects.all_events("cancel"),  # the cancel set
    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>",
]


@dataclass(frozen=True)
class User:
    name: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = ()
    runtime: bool = True  # a stage worker: RUNTIME_PUBLISH and RUNTIME_SUBSCRIBE as well

    @property
    def password_variable(self) -> str:
        return f"NATS_PASSWORD_{self.name.upper()}"

    def allowed(self) -> tuple[list[str], list[str]]:
        publish = [*RUNTIME_PUBLISH, *self.publish] if self.runtime else list(self.publish)
        subscribe = [*RUNTIME_SUBSCRIBE, *self.subscribe] if self.runtime else list(self.subscribe)
        return list(dict.fromkeys(publish)), list(dict.fromkeys(subscribe))


def _buckets(*names: str) -> tuple[str, ...]:
    return tuple(s for name in names for s in bucket(name))


USERS = (
    User(
        "gateway",
        # `accepted`, and the answer on the submitter's inbox (header Brigade-Reply-To)
        (*events("accepted"), "_INBOX.>", *_buckets(subjects.REQUEST_IDS_BUCKET)),
    ),
    User(
        "auth",
        (*events("authorized"), *_buckets(subjects.IDEMPOTENCY_BUCKET, subjects.RATES_BUCKET)),
    ),
    User("context", tuple(events("assembled"))),
    # `tokenized` is routed: llm.ev.<id>.tokenized.<model> (schemas/subjects.py ROUTED_EVENTS)
    User("tokenize", (*events("tokenized"), subjects.routed_events("tokenized"))),
    User("engine", tuple(events("started", "tokens", "finished"))),
    User("detokenize", tuple(events("text", "completed"))),
    User(
        "ledger",
        (*events("billed"), *_buckets(subjects.IDEMPOTENCY_BUCKET, subjects.RATES_BUCKET)),
    ),
    User("archiver", ()),
    User(
        "sweeper",
        # it cancels and ends runs; it pings the edges that follow runs (orphans.py)
        (*events("cancel"), f"{subjects.EDGE_ROOT}.>", *_buckets(subjects.RUNS_BUCKET)),
        tuple(events("accepted", "completed", "cancelled", "failed")),
    ),
    User("ingest", tuple(events("doc_added", "doc_rejected", "doc_deleted", "collection_deleted"))),
    User(
        "edge",
        # submits and cancels; it follows every run's events live; its run-state projector; it
        # answers the sweeper's pings (stages/edge/follow.py)
        (
            subjects.SUBMIT,
            *events("cancel"),
            *_buckets(*EVERY_BUCKET),
            "_INBOX.>",
        ),
        (subjects.ALL_EVENTS, f"{subjects.EDGE_ROOT}.>"),
    ),
    # operators' tools (status, keys, sql, ask, bench, replay) and `brigade up` against this server
    User("admin", (">",), (">",), runtime=False),
)
BY_NAME = {user.name: user for user in USERS}


def _subjects(items: list[str]) -> str:
    return "[" + ", ".join(f'"{s}"' for s in items) + "]"


def render(*, store_dir: str = "/data", max_payload: str = "16MB", http_port: int = 8222) -> str:
    """The nats-server configuration: JetStream and one user per service with its permissions."""
    lines = [
        "# Generated by `python -m tools.nats_auth` from tools/nats_auth.py: edit that, not this.",
        "# Each password is read from the server's environment (NATS_PASSWORD_<USER>).",
        f"max_payload: {max_payload}",
        f"http_port: {http_port}",
        "jetstream {",
        f'  store_dir: "{store_dir}"',
        "}",
        "authorization {",
        "  users: [",
    ]
    for user in USERS:
        publish, subscribe = user.allowed()
        lines += [
            "    {",
            f"      user: {user.name}",
            f"      password: ${user.password_variable}",
            "      permissions: {",
            f"        publish: {{allow: {_subjects(publish)}}}",
            f"        subscribe: {{allow: {_subjects(subscribe)}}}",
            "      }",
            "    }",
        ]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def env_file() -> str:
    """A fresh random password for every user, as compose's .env lines."""
    return "".join(f"{user.password_variable}={secrets.token_urlsafe(24)}\n" for user in USERS)


if __name__ == "__main__":
    print(env_file() if sys.argv[1:] == ["--env"] else render(), end="")
