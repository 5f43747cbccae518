"""The pipeline benchmark's figures, from the events a client received: per request, per
streamed token and per stage; and their markdown table."""

from __future__ import annotations

from dataclasses import dataclass, field

NON_MODEL = ("gateway", "auth", "context", "tokenize", "detokenize")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Seen:
    """Every event of one request with the wall-clock time this client received it."""

    sent_ns: int = 0
    events: list = field(default_factory=list)  # (received_ns, event)
    raw: list = field(default_factory=list)  # (received_ns, bytes) until decoded
    done: object = None


def analyse(seen: dict[str, Seen]) -> dict:
    """Per request: the path's own added latency (submit -> `tokenized` stored, and engine
    `finished` -> client has `completed`) and the non-model stages' service times; per token:
    engine publish -> client receipt of `tokens`, and of the `text` made from it."""
    tag_stage = {
        "accepted": "gateway",
        "authorized": "auth",
        "assembled": "context",
        "tokenized": "tokenize",
    }
    inputs = {"authorized": "accepted", "assembled": "authorized", "tokenized": "assembled"}
    stage_service: dict[str, list[float]] = {s: [] for s in (*NON_MODEL, "ledger")}
    stage_queue: dict[str, list[float]] = {s: [] for s in (*NON_MODEL, "ledger")}
    # a stage's hop: its input stamped (or the client's send) -> its output stamped
    stage_hop: dict[str, list[float]] = {s: [] for s in (*NON_MODEL, "ledger")}
    overhead, service_sum, trips_tokens, trips_text, ttft, e2e, ids = [], [], [], [], [], [], []
    failed = 0
    for rec in seen.values():
        by_tag: dict[str, list] = {}
        for received, event in rec.events:
            by_tag.setdefault(type(event).__struct_config__.tag, []).append((received, event))
        if "completed" not in by_tag:
            failed += 1
            continue
        first = {tag: evs[0][1] for tag, evs in by_tag.items()}
        total_service = 0.0
        for tag, stage in tag_stage.items():
            ev = first[tag]
            total_service += ev.service_ns / 1e6
            stage_service[stage].append(ev.service_ns / 1e6)
            start = ev.ts_ns - ev.service_ns
            came = rec.sent_ns if tag == "accepted" else first[inputs[tag]].ts_ns
            stage_queue[stage].append((start - came) / 1e6)
            stage_hop[stage].append((ev.ts_ns - came) / 1e6)
        tokens = {e.seq: (r, e) for r, e in by_tag.get("tokens", [])}
        for received, text in by_tag.get("text", []):
            stage_service["detokenize"].append(text.service_ns / 1e6)
            source = tokens.get(text.seq)
            if source is not None:
                stage_queue["detokenize"].append(
                    (text.ts_ns - text.service_ns - source[1].ts_ns) / 1e6
                )
                stage_hop["detokenize"].append((text.ts_ns - source[1].ts_ns) / 1e6)
                trips_text.append((received - source[1].ts_ns) / 1e6)
        for received, tok in tokens.values():
            trips_tokens.append((received - tok.ts_ns) / 1e6)
        flush = max(by_tag["text"], key=lambda p: p[1].seq)[1]
        total_service += flush.service_ns / 1e6
        service_sum.append(total_service)
        fin = first["finished"]
        done_received = by_tag["completed"][0][0]
        overhead.append((first["tokenized"].ts_ns - rec.sent_ns + done_received - fin.ts_ns) / 1e6)
        shown = sorted(r for r, e in by_tag["text"] if e.text)
        if shown:
            ttft.append((shown[0] - rec.sent_ns) / 1e6)
        e2e.append((done_received - rec.sent_ns) / 1e6)
        ids.append([t for s in sorted(tokens) for t in tokens[s][1].token_ids])
        for _received, bill in by_tag.get("billed", []):
            stage_service["ledger"].append(bill.service_ns / 1e6)
            stage_queue["ledger"].append(
                (bill.ts_ns - bill.service_ns - first["completed"].ts_ns) / 1e6
            )
            stage_hop["ledger"].append((bill.ts_ns - first["completed"].ts_ns) / 1e6)
    return {
        "overhead_ms": overhead,
        "service_sum_ms": service_sum,
        "token_trip_ms": trips_tokens,
        "text_trip_ms": trips_text,
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "failed": failed,
        "stage_service_ms": stage_service,
        "stage_queue_ms": stage_queue,
        "stage_hop_ms": stage_hop,
        "token_ids": ids,
    }


def _f(x: float | None, nd: int = 2) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def markdown(result: dict) -> str:
    rows = [
        f"{result['requests']} requests per side and level, {result['max_tokens']} output tokens "
        f"each; model: {result['model']}; layout: {result['layout']}; {result['machine']}.",
    ]
    for c, run in result["runs"].items():
        rows += ["", f"### {c} in flight", ""]
        rows += level_markdown(run)
    return "\n".join(rows)


def level_markdown(result: dict) -> list[str]:
    a, p = result["alone"], result["pipeline"]
    t = result["targets"]
    rows = [
        "| per request / per token (ms) | P50 | P95 | target | met |",
        "|---|---:|---:|---|---|",
    ]
    for label, key, target, met in (
        (
            "added latency per request: submit → `tokenized` + `finished` → client",
            "overhead_ms",
            "P50 ≤ 2, P95 ≤ 5",
            t["overhead"],
        ),
        (
            "non-model service time per request (gateway+auth+context+tokenize+detokenize)",
            "service_sum_ms",
            "—",
            None,
        ),
        (
            "streamed token: engine publish → client receives `tokens`",
            "token_trip_ms",
            "P95 ≤ 1",
            t["token_trip"],
        ),
        (
            "streamed token: engine publish → client receives its `text`",
            "text_trip_ms",
            "P95 ≤ 2 at 8 in flight",
            t.get("text_trip"),
        ),
    ):
        xs = p[key]
        rows.append(
            f"| {label} | {_f(pct(xs, 0.5))} | {_f(pct(xs, 0.95))} | {target} | {'—' if met is None else ('yes' if met else 'no')} |"
        )
    bare = result.get("bare_relay")
    added = result.get("added_over_bare") or {}
    rows += [
        "",
        "| stage | service P50 | service P95 | queue P50 | queue P95 | hop P50 | hop − bare relay P50 (≤ 0.5) | samples |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stage, xs in p["stage_service_ms"].items():
        qs = p["stage_queue_ms"][stage]
        hop = added.get(stage, {})
        over = hop.get("added_p50_ms")
        ok = t.get("added_per_hop", {}).get(stage)
        rows.append(
            f"| {stage} | {_f(pct(xs, 0.5), 3)} | {_f(pct(xs, 0.95), 3)} | {_f(pct(qs, 0.5), 3)} | {_f(pct(qs, 0.95), 3)} | "
            f"{_f(hop.get('hop_p50_ms'), 3)} | {_f(over, 3)}{'' if ok is None else (' ✓' if ok else ' ✗')} | {len(xs)} |"
        )
    if bare is not None:
        rows += [
            "",
            f"Bare relay on the same server (one JetStream hop through a Python relay, no stage code, "
            f"{bare['messages']} messages in bursts of {result['concurrency']}): P50 {bare['p50_ms']:.3f} ms, "
            f"P95 {bare['p95_ms']:.3f} ms.",
            "",
            "A streamed token's text takes the relay's path (engine -> log -> detokenize -> log "
            "-> edge), so the relay's P95 is the text trip's floor at this burst size: "
            f"{bare['p95_ms']:.2f} ms, against the text trip's {_f(pct(p['text_trip_ms'], 0.95))} "
            f"ms{_floor_verdict(bare['p95_ms'], result)}.",
        ]
    rows += [
        "",
        "| same requests | TTFT P50 | TTFT P95 | E2E P50 | E2E P95 | output tok/s |",
        "|---|---:|---:|---:|---:|---:|",
        f"| engine alone | {_f(pct(a['ttft_ms'], 0.5), 0)} | {_f(pct(a['ttft_ms'], 0.95), 0)} | {_f(pct(a['e2e_ms'], 0.5), 0)} | {_f(pct(a['e2e_ms'], 0.95), 0)} | {a['tokens'] / a['wall_s']:.1f} |",
        f"| full pipeline | {_f(pct(p['ttft_ms'], 0.5), 0)} | {_f(pct(p['ttft_ms'], 0.95), 0)} | {_f(pct(p['e2e_ms'], 0.5), 0)} | {_f(pct(p['e2e_ms'], 0.95), 0)} | {p['tokens'] / p['wall_s']:.1f} |",
        "",
        f"identical token ids on both sides: {result['same_token_ids']}; failed through the "
        f"pipeline: {p['failed']}.",
    ]
    return rows


def _floor_verdict(floor_p95_ms: float, result: dict) -> str:
    """Where the text trip has a target at this level: whether the floor leaves room for it."""
    targets = result["targets"]
    target = targets.get("text_trip_target_p95_ms")
    if targets.get("text_trip") is None or target is None:
        return ""
    if floor_p95_ms > target:
        return f"; the {target:g} ms target is below the floor"
    return f"; the {target:g} ms target is above it"
