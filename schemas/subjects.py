"""Every NATS subject, stream, durable and KV bucket name, spelled once.

Subjects never carry user text: a request id is checked against REQUEST_ID_PATTERN before it
becomes a subject token.
"""

from __future__ import annotations

import hashlib
import re

SUBMIT = "llm.in"  # JSON `Submit` payloads; the gateway answers on the reply subject
EVENT_ROOT = "llm.ev"  # llm.ev.<request_id>.<event>[.<model>]
# Events whose subject carries one more token, the model they are for: JetStream routes them to
# that model's engine workers (each model's engines share a durable filtered on its token).
ROUTED_EVENTS = ("tokenized",)  # llm.ev.<request_id>.tokenized.<model token>
# JetStream keeps no reply subject on a stored message (a core request to llm.in gets the stream's
# PubAck), so a submitter that wants the gateway's answer names its inbox in this header.
REPLY_HEADER = "Brigade-Reply-To"
# A submit's API key travels in this header, not in its body; the gateway hashes it and forwards
# only the hash, and llm.in's queue is in memory, so the key never rests on disk.
API_KEY_HEADER = "Brigade-Api-Key"

EVENTS_STREAM = "BRIGADE_EVENTS"  # limits retention, file storage, over llm.ev.>
SUBMIT_STREAM = "BRIGADE_IN"  # work queue over llm.in: a submission is gone once accepted
DEAD_STREAM = "BRIGADE_DEAD"  # limits retention over llm.dead.>: what no consumer could handle
DEAD_ROOT = "llm.dead"  # llm.dead.<consumer>
EDGE_ROOT = "llm.edge"  # core request/reply only, in no stream: who follows runs for clients

IDEMPOTENCY_BUCKET = "brigade_idempotency"
RUNS_BUCKET = "brigade_runs"
RATES_BUCKET = "brigade_rates"
REQUEST_IDS_BUCKET = "brigade_request_ids"  # request id -> the tenant that owns it
STAGES_BUCKET = "brigade_stages"  # <stage>.<worker> -> its latest heartbeat (liveness, readiness)

# Letters, digits, '_' and '-': no '.', '*', '>' or spaces, so an id is always one subject token.
# (?!\n) because Python's "$" also matches before a final newline; the form stays valid JSON
# Schema (ECMA-262) for `brigade schema`.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}(?!\n)$"


_TOKEN_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,48}(?!\n)$")


def model_token(model: str) -> str:
    """A served model's id as one subject token: the id itself when it is letters, digits, '_'
    and '-' (at most 48), else a readable slug of it plus a digest of the whole id, so a path
    or a name with dots (`Llama-3.2-1B`) routes too and two ids never share a token."""
    if _TOKEN_SAFE.match(model):
        return model
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", model)[-32:].strip("_") or "model"
    return f"{slug}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


def event_subject(request_id: str, event: str, route: str | None = None) -> str:
    """Where an event is stored; `route` (a model token) only for ROUTED_EVENTS."""
    base = f"{EVENT_ROOT}.{request_id}.{event}"
    return base if route is None else f"{base}.{route}"


def request_events(request_id: str) -> str:
    """Every event of one request: what a client subscribes to before it submits."""
    return f"{EVENT_ROOT}.{request_id}.>"


def all_events(event: str, route: str | None = None) -> str:
    """One kind of event across requests: a stage's consumer filter (with `route`, only those
    routed to one model)."""
    base = f"{EVENT_ROOT}.*.{event}"
    return base if route is None else f"{base}.{route}"


def routed_events(event: str) -> str:
    """One kind of routed event for every model (a publisher's permission)."""
    return f"{EVENT_ROOT}.*.{event}.>"


ALL_EVENTS = f"{EVENT_ROOT}.>"


def msg_id(request_id: str, event: str, seq: int | None = None) -> str:
    """`Nats-Msg-Id` for JetStream dedupe: a retried publish is stored once."""
    return f"{request_id}:{event}" if seq is None else f"{request_id}:{event}:{seq}"


def dead_letter(consumer: str) -> str:
    """Where `consumer` records a message it could not decode or handle (deadletter.py)."""
    return f"{DEAD_ROOT}.{consumer}"


ALL_DEAD = f"{DEAD_ROOT}.>"


def edge_ping(edge_worker: str) -> str:
    """An edge worker answers a request here while it is connected (the sweeper asks)."""
    return f"{EDGE_ROOT}.ping.{edge_worker}"


def run_followers(request_id: str) -> str:
    """Every edge following a run for a client answers a request here."""
    return f"{EDGE_ROOT}.follow.{request_id}"


def max_deliveries_advisory(stream: str, durable: str) -> str:
    """JetStream's notice that a message was delivered max_deliver times without an ack."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"


def durable_name(stage: str, route: str | None = None) -> str:
    """A stage's shared durable; one per model (`route`) for the engine."""
    return f"brigade-{stage}" if route is None else f"brigade-{stage}-{route}"
