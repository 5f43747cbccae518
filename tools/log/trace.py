"""`brigade trace REQUEST_ID`: one request's waterfall — every event with its offset from arrival,
queue wait and service time per stage — as text and, with `--png FILE`, as a picture."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from schemas.subjects import REQUEST_ID_PATTERN

# Which stage publishes each event type (the failed event names its own stage).
PUBLISHER = {
    "accepted": "gateway",
    "authorized": "auth",
    "assembled": "context",
    "tokenized": "tokenize",
    "started": "engine",
    "tokens": "engine",
    "finished": "engine",
    "text": "detokenize",
    "completed": "detokenize",
    "billed": "ledger",
    "cancel": "client",
}


def register(subparsers) -> None:
    from tools.log.views import add_source_args

    p = subparsers.add_parser("trace", help="one request's events and per-stage times")
    p.add_argument("request_id")
    p.add_argument("--png", type=Path, metavar="FILE", help="also draw the waterfall to FILE")
    add_source_args(p)
    p.set_defaults(func=run)


def _detail(event_type: str, data: dict) -> str:
    match event_type:
        case "accepted":
            request = data.get("request", {})
            return f"{len(request.get('messages', []))} message(s)"
        case "assembled":
            return (
                f"{data.get('num_prompt_tokens', 0)} prompt tokens"
                + (", truncated" if data.get("truncated") else "")
                + _retrieval_detail(data.get("retrieval"))
            )
        case "tokenized":
            return f"{len(data.get('prompt_token_ids', []))} prompt token ids"
        case "tokens":
            return f"ids {data.get('token_ids')}"
        case "text":
            return json.dumps(data.get("text", ""), ensure_ascii=False)
        case "finished" | "completed":
            usage = data.get("usage", {})
            return (
                f"{data.get('finish_reason')}; {usage.get('prompt_tokens', 0)} in, "
                f"{usage.get('completion_tokens', 0)} out"
            )
        case "failed":
            return f"{data.get('code')} at {data.get('stage')}: {data.get('message')}"
        case "billed":
            return str(data.get("status"))
        case "cancel" | "cancelled":
            return str(data.get("reason"))
    return ""


def _retrieval_detail(trace: dict | None) -> str:
    if not trace:
        return ""
    return (
        f"; retrieved {trace.get('num_kept', 0)} of {trace.get('num_candidates', 0)} chunks "
        f"({trace.get('num_tokens', 0)} tokens), search {trace.get('search_ns', 0) / 1e6:.1f} ms, "
        f"rerank {trace.get('rerank_ns', 0) / 1e6:.1f} ms"
        + (f" (fell back: {trace['rerank_fallback']})" if trace.get("rerank_fallback") else "")
    )


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def format_retrieval(con, request_id: str) -> list[str]:
    """The request's retrieval candidates, best first, with their scores and fate."""
    rows = con.execute(
        "SELECT chunk_id, source, num_tokens, vector_score, keyword_score, fused_score, "
        "rerank_score, reason FROM retrieved_chunks WHERE request_id = ?",
        [request_id],
    ).fetchall()
    if not rows:
        return []
    out = [
        "",
        f"{'chunk':<32} {'tokens':>6} {'vector':>7} {'bm25':>7} {'fused':>7} {'rerank':>7}  "
        "fate  source",
    ]
    for chunk_id, source, num_tokens, vec, kw, fused, rerank, reason in rows:
        out.append(
            f"{chunk_id:<32} {num_tokens:>6} {_score(vec):>7} {_score(kw):>7} {_score(fused):>7} "
            f"{_score(rerank):>7}  {reason:<5} {source}"
        )
    return out


def format_trace(con, request_id: str) -> str | None:
    """The text waterfall of one request; None when the log has no event of it."""
    head = con.execute(
        "SELECT tenant, status, finish_reason, tokens_in, tokens_out, arrival_ns, ttft_ms, "
        "e2e_ms, tpot_ms, error_message FROM requests WHERE request_id = ?",
        [request_id],
    ).fetchone()
    if head is None:
        return None
    tenant, status, reason, tokens_in, tokens_out, arrival_ns, ttft, e2e, tpot, error = head
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(arrival_ns // 1_000_000_000))

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f} ms"

    out = [
        f"request {request_id}  tenant {tenant or '—'}  {status or 'in flight'}"
        + (f" ({reason})" if reason else "")
        + (f": {error}" if error else ""),
        f"arrived {clock}.{arrival_ns % 1_000_000_000 // 1_000_000:03d} UTC  tokens in "
        f"{tokens_in}, out {tokens_out}  TTFT {ms(ttft)}  TPOT {ms(tpot)}  E2E {ms(e2e)}",
        "",
        f"{'offset ms':>10}  {'event':<10} {'seq':>4} {'service ms':>10}  {'stage':<10} detail",
    ]
    events = con.execute(
        "SELECT ts_ns, type, seq, service_ns, data FROM ev WHERE request_id = ? "
        "ORDER BY ts_ns, stream_seq",
        [request_id],
    ).fetchall()
    for ts_ns, event_type, seq, service_ns, data in events:
        payload = json.loads(data) if data else {}
        stage = payload.get("stage") if event_type == "failed" else PUBLISHER.get(event_type, "")
        out.append(
            f"{(ts_ns - arrival_ns) / 1e6:>10.2f}  {event_type:<10} "
            f"{'' if seq is None else seq:>4} {service_ns / 1e6:>10.3f}  {stage or '':<10} "
            f"{_detail(event_type, payload)}"
        )
    out += ["", f"{'stage':<10} {'hops':>5} {'queue ms':>10} {'service ms':>11}"]
    for stage, hops, queue_ms, service_ms in con.execute(
        "SELECT stage, num_hops, queue_ms, service_ms FROM request_stages WHERE request_id = ? "
        "ORDER BY stage_order",
        [request_id],
    ).fetchall():
        out.append(f"{stage:<10} {hops:>5} {queue_ms:>10.3f} {service_ms:>11.3f}")
    out += format_retrieval(con, request_id)
    return "\n".join(out)


def draw_trace(con, request_id: str, path: Path) -> Path:
    """The request's waterfall: one row per stage, every hop with its queue and service."""
    from tools.log.plots import Hop, waterfall

    rows = con.execute(
        "SELECT h.stage, (h.in_ns - r.arrival_ns) / 1e6, (h.start_ns - r.arrival_ns) / 1e6, "
        "(h.end_ns - r.arrival_ns) / 1e6, r.ttft_ms FROM stage_hops h "
        "JOIN requests r USING (request_id) WHERE request_id = ? ORDER BY h.stage_order, h.seq",
        [request_id],
    ).fetchall()
    by_stage: dict[str, list[Hop]] = {}
    ttft = None
    for stage, in_ms, start_ms, end_ms, ttft_ms in rows:
        by_stage.setdefault(stage, []).append(
            Hop(stage=stage, in_ms=in_ms, start_ms=start_ms, end_ms=end_ms)
        )
        ttft = ttft_ms
    marks = {"engine": ttft} if ttft is not None and "engine" in by_stage else None
    return waterfall(list(by_stage.items()), path, f"Trace of request {request_id}", marks)


def run(args) -> int:
    import re

    from tools.log.views import default_archive_dir, open_log

    if not re.match(REQUEST_ID_PATTERN, args.request_id):
        print(
            f"brigade trace: {args.request_id!r} is not a request id (letters, digits, _ and -, "
            "1 to 64 characters)",
            file=sys.stderr,
        )
        return 2
    con = open_log(args, request_id=args.request_id)
    text = format_trace(con, args.request_id)
    if text is None:
        print(
            f"brigade trace: no events of request {args.request_id} in the archive "
            f"({args.archive or default_archive_dir()}) or the stream; recent ids: brigade sql "
            '"SELECT request_id FROM requests ORDER BY arrival_ns DESC LIMIT 10"',
            file=sys.stderr,
        )
        return 1
    print(text)
    if args.png is not None:
        print(f"wrote {draw_trace(con, args.request_id, args.png)}")
    return 0
