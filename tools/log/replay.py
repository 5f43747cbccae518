"""`brigade replay REQUEST_ID`: re-stream a run's text from the log exactly as its client received
it (text deltas in `seq` order); `--rerun` submits the same input with the same seed again and
diffs the token ids."""

from __future__ import annotations

import json
import re
import sys
import time
import uuid

from schemas.subjects import REQUEST_ID_PATTERN


def register(subparsers) -> None:
    from tools.log.views import add_source_args

    p = subparsers.add_parser("replay", help="re-stream a run's text from the event log")
    p.add_argument("request_id")
    p.add_argument("--timing", action="store_true", help="keep the original pauses between deltas")
    p.add_argument("--speed", type=float, default=1.0, help="with --timing: play N times faster")
    p.add_argument(
        "--rerun",
        action="store_true",
        help="submit the same input with the same seed again and compare the token ids",
    )
    p.add_argument("--api-key", help="key for --rerun (default: $BRIGADE_API_KEY or dev key)")
    p.add_argument("--timeout", type=float, default=120.0, help="--rerun: seconds to wait")
    add_source_args(p)
    p.set_defaults(func=run)


def text_deltas(con, request_id: str) -> list[tuple[int, int, str]]:
    """(seq, ts_ns, text) of every text delta of the run, in seq order (each seq once)."""
    return con.execute(
        "SELECT seq, ts_ns, text FROM ev WHERE request_id = ? AND type = 'text' ORDER BY seq",
        [request_id],
    ).fetchall()


def missing_seqs(con, request_id: str, deltas: list[tuple[int, int, str]]) -> list[int]:
    """Seqs the log lacks between 0 and the run's last text seq (per its `completed` event)."""
    row = con.execute(
        "SELECT max(TRY_CAST(data ->> '$.last_seq' AS BIGINT)) FROM ev "
        "WHERE request_id = ? AND type = 'completed'",
        [request_id],
    ).fetchone()
    have = {seq for seq, _, _ in deltas}
    last = row[0] if row and row[0] is not None else max(have, default=-1)
    return [seq for seq in range(last + 1) if seq not in have]


def original_input(con, request_id: str):
    """The run's accepted request and the seed it ran with (the engine's, else the client's)."""
    from schemas.events import RequestAccepted, decode_event

    row = con.execute(
        "SELECT data FROM ev WHERE request_id = ? AND type = 'accepted'", [request_id]
    ).fetchone()
    if row is None:
        return None, None
    accepted = decode_event(row[0].encode())
    assert isinstance(accepted, RequestAccepted)
    seed_row = con.execute(
        "SELECT TRY_CAST(data ->> '$.seed' AS BIGINT) FROM ev WHERE request_id = ? "
        "AND type IN ('finished', 'completed') ORDER BY stream_seq LIMIT 1",
        [request_id],
    ).fetchone()
    seed = seed_row[0] if seed_row and seed_row[0] is not None else accepted.request.sampling.seed
    return accepted.request, seed


def submit_for(request, seed: int | None, request_id: str, api_key: str | None):
    """A Submit that asks for exactly the same run (no idempotency key: a new run)."""
    from schemas.events import Submit

    s = request.sampling
    raw = request.raw_prompt and len(request.messages) == 1
    return Submit(
        request_id=request_id,
        api_key=api_key,
        model=request.model,
        messages=None if raw else list(request.messages),
        prompt=request.messages[0].content if raw else None,
        system=request.system,
        documents=list(request.documents),
        truncation=request.truncation,
        priority=request.priority,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        min_tokens=s.min_tokens,
        seed=seed,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def rerun(submit, timeout_s: float):
    """Submit again through the bus and wait for the new run; its RunRecord."""
    import anyio

    from tools.busclient import EventTap
    from tools.log.source import connect

    bus = await connect("brigade-replay")
    tap = EventTap(bus.nc, subject=f"llm.ev.{submit.request_id}.>")
    try:
        await tap.start()
        record = await tap.submit(bus.js, submit)
        with anyio.fail_after(timeout_s):
            await record.done.wait()
        return record
    finally:
        await tap.stop()
        await bus.close()


def run(args) -> int:
    from tools.log.views import open_log

    if not re.match(REQUEST_ID_PATTERN, args.request_id):
        print(f"brigade replay: {args.request_id!r} is not a request id", file=sys.stderr)
        return 2
    con = open_log(args, request_id=args.request_id)
    deltas = text_deltas(con, args.request_id)
    if not deltas:
        print(f"brigade replay: no text of request {args.request_id} in the log", file=sys.stderr)
        return 1
    previous = None
    for _, ts_ns, text in deltas:
        if args.timing and previous is not None:
            time.sleep(max(ts_ns - previous, 0) / 1e9 / max(args.speed, 1e-6))
        previous = ts_ns
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    gaps = missing_seqs(con, args.request_id, deltas)
    if gaps:
        print(f"brigade replay: the log lacks text seqs {gaps}", file=sys.stderr)
        return 1
    if not args.rerun:
        return 0
    return _rerun(con, args)


def _rerun(con, args) -> int:
    import anyio

    from stages.tenancy.tenants import dev_key

    request, seed = original_input(con, args.request_id)
    if request is None:
        print("brigade replay: the log has no `accepted` event to rerun", file=sys.stderr)
        return 1
    original = [
        t
        for (ids,) in con.execute(
            "SELECT data ->> '$.token_ids' FROM ev WHERE request_id = ? AND type = 'tokens' "
            "ORDER BY seq",
            [args.request_id],
        ).fetchall()
        for t in json.loads(ids)
    ]
    new_id = f"{args.request_id[:40]}-rerun-{uuid.uuid4().hex[:8]}"
    submit = submit_for(request, seed, new_id, args.api_key or dev_key())
    try:
        record = anyio.run(rerun, submit, args.timeout)
    except RuntimeError as err:
        print(f"brigade replay: {err}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(
            f"brigade replay: rerun {new_id} did not finish in {args.timeout:g} s (--timeout)",
            file=sys.stderr,
        )
        return 1
    if not record.ok:
        print(f"brigade replay: rerun {new_id} ended with {record.terminal}", file=sys.stderr)
        return 1
    again = record.all_token_ids()
    where = first_difference(original, again)
    print(f"rerun {new_id} (seed {seed}): {len(again)} token ids vs {len(original)} originally")
    if where is None:
        print("identical token ids")
        return 0
    print(f"token ids differ from position {where}:")
    print(f"  original: {original[where : where + 12]}")
    print(f"  rerun:    {again[where : where + 12]}")
    return 1
