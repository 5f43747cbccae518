"""The websocket fuzzer: 341 seeded bad `response.create` frames on one socket of the real edge
(real nats-server, real gateway stage); each gets an `error` event naming the field, the socket
stays open, and a normal response.create is accepted afterwards."""

from __future__ import annotations

import json

import anyio
import pytest
import websockets

from stages import gateway
from stages.runtime import worker as runtime
from stages.runtime.bus import BusConfig
from tests.schemas.submit_fuzz import bad_cases, names
from tests.stages.edge_harness import ACME_KEY, keyring_for_tests, running_edge

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}


def frame(response: bytes) -> str:
    return '{"type": "response.create", "response": ' + response.decode() + "}"


async def test_every_bad_frame_is_an_error_naming_its_field_and_the_socket_lives(
    bus_config: BusConfig, tmp_path
) -> None:
    cases = list(bad_cases(seed=23))
    assert len(cases) >= 300
    stop, ready = anyio.Event(), anyio.Event()
    wrong = []
    async with (
        running_edge(bus_config, keyring_for_tests(tmp_path), max_frame_bytes=4 << 20) as edge,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(
            lambda: runtime.serve(
                gateway.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        async with websockets.connect(edge.ws_url, additional_headers=AUTH) as ws:
            for case in cases:
                await ws.send(frame(case.submit()))
                answer = json.loads(await ws.recv())
                error = answer.get("error") or {}
                field = error.get("field")
                if answer["type"] != "error" or not (
                    names(field, case.field) or names(field, f"response.{case.field}")
                ):
                    wrong.append((case.field, case.value[:40], answer))
            await ws.send(frame(b'{"messages": [{"role": "user", "content": "hi"}]}'))
            created = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "response.cancel"}))
        stop.set()
    assert not wrong, wrong[:10]
    assert created["type"] == "response.created", created
