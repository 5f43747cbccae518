"""The dead-letter stream: a message that a consumer could not decode or handle, and could not
fail as a `failed` event of a request it names, is recorded here once with the reason, then
terminated (AckTerm), so it is never redelivered in a loop.

One `DeadLetter` per (stream, stream seq, consumer), stored on `llm.dead.<consumer>` in the
BRIGADE_DEAD stream with that triple as its `Nats-Msg-Id`: a redelivery records nothing new.
It keeps the first `MAX_KEPT_BYTES` of the payload (the log keeps all of it, by seq), with any
`"api_key"` value blanked: a dead letter rests on disk, and an older client's submit carried
its key in the body. Recording
never raises: a dead letter that cannot be stored is logged, and the message is still settled.
"""

from __future__ import annotations

import logging
import re
import time

import anyio
import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from schemas import subjects
from schemas.bounded import decode_bounded

log = logging.getLogger("brigade.deadletter")
MAX_KEPT_BYTES = 4096
MSG_ID_HEADER = "Nats-Msg-Id"
RECORD_TIMEOUT_S = 5.0
_API_KEY = re.compile(rb'"api_key"\s*:\s*"(?:[^"\\]|\\.)*"?')  # to its end, or the payload's


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    consumer: str  # the stage (or service) that gave up on it
    reason: str
    subject: str
    stream: str | None = None
    stream_seq: int | None = None
    num_delivered: int | None = None
    request_id: str | None = None  # when the payload names one (it got no `failed` event)
    size: int = 0  # the payload's bytes
    data: str = ""  # its first MAX_KEPT_BYTES, as UTF-8 with replacement characters
    ts_ns: int = 0


_decoder = msgspec.json.Decoder(DeadLetter)


def letter_for(consumer: str, msg: Msg, reason: str, request_id: str | None = None) -> DeadLetter:
    stream = seq = delivered = None
    try:
        meta = msg.metadata
        stream, seq, delivered = meta.stream, meta.sequence.stream, meta.num_delivered
    except Exception:  # noqa: BLE001 - a core message has no JetStream metadata
        pass
    data = _API_KEY.sub(b'"api_key":"[removed]"', msg.data or b"")
    return DeadLetter(
        consumer=consumer,
        reason=reason[:2000],
        subject=msg.subject,
        stream=stream,
        stream_seq=seq,
        num_delivered=delivered,
        request_id=request_id,
        size=len(msg.data or b""),
        data=data[:MAX_KEPT_BYTES].decode("utf-8", errors="replace"),
        ts_ns=time.time_ns(),
    )


async def record(js: JetStreamContext, letter: DeadLetter) -> bool:
    """Store `letter` (deduped by stream, seq and consumer); False when it could not be."""
    key = f"{letter.stream}:{letter.stream_seq}:{letter.consumer}"
    if letter.stream_seq is None:
        key = f"{letter.subject}:{letter.ts_ns}:{letter.consumer}"
    try:
        with anyio.fail_after(RECORD_TIMEOUT_S):
            await js.publish(
                subjects.dead_letter(letter.consumer),
                msgspec.json.encode(letter),
                headers={MSG_ID_HEADER: key},
            )
        log.warning(
            "dead letter from %s: %s seq %s on %s: %s",
            letter.consumer, letter.stream, letter.stream_seq, letter.subject, letter.reason,
        )  # fmt: skip
        return True
    except Exception as err:  # noqa: BLE001 - the dead-letter path itself never crashes
        log.error(
            "could not record a dead letter from %s (%s seq %s on %s: %s): %s",
            letter.consumer, letter.stream, letter.stream_seq, letter.subject, letter.reason, err,
        )  # fmt: skip
        return False


async def bury(js: JetStreamContext, consumer: str, msg: Msg, reason: str,
               request_id: str | None = None) -> None:  # fmt: skip
    """Record `msg` as a dead letter, then terminate it (never redelivered), whatever fails."""
    await record(js, letter_for(consumer, msg, reason, request_id))
    try:
        await msg.term()
    except Exception as err:  # noqa: BLE001 - unterminated, it comes back once and is buried again
        log.warning("could not terminate %s: %s", msg.subject, err)


def decode(data: bytes) -> DeadLetter:
    return decode_bounded(_decoder, data)
