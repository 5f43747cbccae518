"""Who follows a run for its client, as NATS itself knows it: an edge worker answers pings on
`llm.edge.ping.<edge_worker>` while it is connected, and every run it follows on
`llm.edge.follow.<request_id>`. A killed edge's subscriptions end with its connection, at once,
so the sweeper (stages/eventlog/orphans.py) learns within a ping that the runs the edge
submitted (their `edge_worker`) have nobody left to tell, and cancels them.

Core request/reply only: the subjects are in no stream, and a ping is answered with an empty
body.
"""

from __future__ import annotations

import uuid

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import subjects


def new_edge_worker() -> str:
    """An id for one edge worker: one subject token, new at every start (a restarted edge is
    another worker: the runs of the one before have nobody left)."""
    return "edge-" + uuid.uuid4().hex[:16]


async def _answer(msg: Msg) -> None:
    if msg.reply:
        await msg.respond(b"")


async def answer_pings(nc: NATS, subject: str) -> Subscription:
    """Answer every request on `subject` until the subscription (or the connection) ends."""
    return await nc.subscribe(subject, cb=_answer)


async def answer_edge_pings(nc: NATS, edge_worker: str) -> Subscription:
    return await answer_pings(nc, subjects.edge_ping(edge_worker))


async def answer_run_follows(nc: NATS, request_id: str) -> Subscription:
    return await answer_pings(nc, subjects.run_followers(request_id))
