"""Synthetic event logs built from the real schemas.events Structs, with hand-computed timings.

Request "req-a" (tenant acme) completes with 3 tokens; "req-b" (tenant zeta) fails at auth. All
times are offsets in milliseconds from T0; the expected figures are worked out in test_views.py.
"""

from __future__ import annotations

import random

from schemas import events as ev
from schemas.logrows import row_from_message
from schemas.subjects import event_subject

T0 = 1_800_000_000_000_000_000  # ns, wall clock
MS = 1_000_000

REQUEST = ev.Request(messages=[ev.Message(role="user", content="Say hello")])
SAMPLING = ev.Sampling(temperature=0.0, max_tokens=3, seed=7)


def at(ms: float) -> int:
    return T0 + round(ms * MS)


def dur(ms: float) -> int:
    return round(ms * MS)


def request_a() -> list[ev.Event]:
    rid, tenant = "req-a", "acme"
    return [
        ev.RequestAccepted(request_id=rid, request=REQUEST, received_ns=at(0), ts_ns=at(1.0), service_ns=dur(0.5)),
        ev.RequestAuthorized(request_id=rid, tenant=tenant, request=REQUEST, ts_ns=at(3), service_ns=dur(1)),
        ev.ContextAssembled(request_id=rid, tenant=tenant, request=REQUEST, num_prompt_tokens=5, ts_ns=at(6), service_ns=dur(2)),
        ev.PromptTokenized(request_id=rid, tenant=tenant, prompt_token_ids=[1, 9, 8, 7, 2], sampling=SAMPLING, ts_ns=at(8), service_ns=dur(1)),
        ev.TokensGenerated(request_id=rid, tenant=tenant, seq=0, token_ids=[101], ts_ns=at(58), service_ns=dur(40)),
        ev.TextGenerated(request_id=rid, tenant=tenant, seq=0, text="Hel", ts_ns=at(59), service_ns=dur(0.2)),
        ev.TokensGenerated(request_id=rid, tenant=tenant, seq=1, token_ids=[102], ts_ns=at(78), service_ns=dur(20)),
        ev.TextGenerated(request_id=rid, tenant=tenant, seq=1, text="lo", ts_ns=at(79), service_ns=dur(0.2)),
        ev.TokensGenerated(request_id=rid, tenant=tenant, seq=2, token_ids=[103], ts_ns=at(98), service_ns=dur(20), num_waiting=1, num_running=1, kv_usage=0.25),
        ev.TextGenerated(request_id=rid, tenant=tenant, seq=2, text="", ts_ns=at(99), service_ns=dur(0.2)),
        ev.RunFinished(request_id=rid, tenant=tenant, finish_reason="stop", usage=ev.Usage(prompt_tokens=5, completion_tokens=3), last_seq=2, seed=7, queue_ns=dur(10), prefill_ns=dur(40), decode_ns=dur(40), ts_ns=at(100), service_ns=dur(1), num_waiting=0, num_running=0, kv_usage=0.3125),
        ev.TextGenerated(request_id=rid, tenant=tenant, seq=3, text="!", ts_ns=at(101), service_ns=dur(0.3)),
        ev.RunCompleted(request_id=rid, tenant=tenant, finish_reason="stop", usage=ev.Usage(prompt_tokens=5, completion_tokens=3), last_seq=3, ts_ns=at(102), service_ns=dur(0.1)),
        ev.RunBilled(request_id=rid, tenant=tenant, status="completed", usage=ev.Usage(prompt_tokens=5, completion_tokens=3), ts_ns=at(104), service_ns=dur(1)),
    ]  # fmt: skip


def request_b() -> list[ev.Event]:
    rid, tenant = "req-b", "zeta"
    return [
        ev.RequestAccepted(request_id=rid, request=REQUEST, received_ns=at(9.5), ts_ns=at(10), service_ns=dur(0.3)),
        ev.RequestFailed(request_id=rid, tenant=tenant, stage="auth", code="unauthorized", message="unknown API key", ts_ns=at(12), service_ns=dur(0.4)),
        ev.RunBilled(request_id=rid, tenant=tenant, status="failed", ts_ns=at(14), service_ns=dur(0.5)),
    ]  # fmt: skip


def to_rows(events: list[ev.Event], first_stream_seq: int = 1) -> list[dict]:
    """Rows as the archiver writes them; the store time is the publish time plus 0.1 ms."""
    return [
        row_from_message(
            first_stream_seq + i,
            e.ts_ns + dur(0.1),
            event_subject(e.request_id, type(e).__struct_config__.tag),
            ev.encode(e),
        )
        for i, e in enumerate(events)
    ]


def example_rows() -> list[dict]:
    """req-a and req-b interleaved by publish time, plus two redelivered duplicates of req-a's
    seq-1 `tokens` and `text` events (a later stream seq, the same facts)."""
    events = sorted(request_a() + request_b(), key=lambda e: e.ts_ns)
    duplicates = [e for e in request_a() if getattr(e, "seq", None) == 1]
    return to_rows(events + duplicates)


def generated_request(rid: str, tenant: str, start_ms: float, rng: random.Random) -> list[ev.Event]:
    """A plausible completed request with random timings (for plots, not for exact answers)."""
    t = start_ms
    out: list[ev.Event] = [
        ev.RequestAccepted(request_id=rid, request=REQUEST, received_ns=at(t), ts_ns=at(t + 0.4), service_ns=dur(0.3))
    ]  # fmt: skip
    t += 0.4
    for cls in (ev.RequestAuthorized, ev.ContextAssembled):
        t += rng.uniform(0.3, 2.0)
        out.append(
            cls(request_id=rid, tenant=tenant, request=REQUEST, ts_ns=at(t), service_ns=dur(0.2))
        )
    t += rng.uniform(0.3, 2.0)
    out.append(
        ev.PromptTokenized(
            request_id=rid,
            tenant=tenant,
            prompt_token_ids=[1, 2, 3],
            ts_ns=at(t),
            service_ns=dur(0.5),
        )
    )
    start_engine = t
    t += rng.uniform(50, 400)
    num_tokens = rng.randint(2, 12)
    for seq in range(num_tokens):
        out.append(
            ev.TokensGenerated(
                request_id=rid,
                tenant=tenant,
                seq=seq,
                token_ids=[100 + seq],
                ts_ns=at(t),
                service_ns=dur(5),
                num_waiting=rng.randint(0, 5),
                kv_usage=rng.uniform(0.1, 0.6),
            )
        )
        out.append(
            ev.TextGenerated(
                request_id=rid,
                tenant=tenant,
                seq=seq,
                text=f"w{seq} ",
                ts_ns=at(t + 0.3),
                service_ns=dur(0.1),
            )
        )
        t += rng.uniform(15, 40)
    out.append(
        ev.RunFinished(
            request_id=rid,
            tenant=tenant,
            finish_reason="length",
            usage=ev.Usage(prompt_tokens=3, completion_tokens=num_tokens),
            last_seq=num_tokens - 1,
            prefill_ns=dur(40),
            decode_ns=dur(t - start_engine - 40),
            ts_ns=at(t),
            service_ns=dur(1),
        )
    )
    out.append(
        ev.RunCompleted(
            request_id=rid,
            tenant=tenant,
            finish_reason="length",
            last_seq=num_tokens - 1,
            ts_ns=at(t + 0.5),
            service_ns=dur(0.1),
        )
    )
    return out  # fmt: skip


def generated_rows(num_requests: int = 30, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    events: list[ev.Event] = []
    for i in range(num_requests):
        tenant = "acme" if i % 3 else "zeta"
        events += generated_request(f"gen-{i:03d}", tenant, i * 50.0, rng)
    return to_rows(sorted(events, key=lambda e: e.ts_ns))
