"""The edge's door against a real nats-server: keys, limits on bodies, headers and frames,
ownership of runs, health and metrics. (Whole runs through the pipeline: test_edge_e2e.py.)"""

import json
import socket

import anyio
import httpx
import pytest
import websockets

from schemas import subjects
from schemas.events import Request, RequestAuthorized
from stages.edge.app import serve
from stages.edge.core import EdgeConfig
from stages.runtime.bus import Bus
from tests.stages.edge_harness import ACME_KEY, GLOBEX_KEY, MODEL, keyring_for_tests, running_edge
from tools.stage_procs import connected

pytestmark = pytest.mark.anyio
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_keys_models_and_limits(bus_config, tmp_path):
    async with (
        running_edge(bus_config, keyring_for_tests(tmp_path)) as edge,
        httpx.AsyncClient(base_url=edge.url) as http,
    ):
        r = await http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
        r = await http.post("/v1/chat/completions", json=CHAT, headers=_auth("sk-wrong-key"))
        assert r.status_code == 401
        assert "sk-wrong-key" not in r.text  # a key never appears in an error
        r = await http.post("/v1/chat/completions", json=CHAT, headers=_auth(GLOBEX_KEY))
        assert r.status_code == 403
        assert r.json()["error"]["param"] == "model"
        assert GLOBEX_KEY not in r.text
        r = await http.get("/v1/models", headers=_auth(ACME_KEY))
        assert [m["id"] for m in r.json()["data"]] == [MODEL]
        r = await http.get("/v1/models", headers=_auth(GLOBEX_KEY))
        assert r.json()["data"] == []

        r = await http.post("/v1/chat/completions", content=b"{nope", headers=_auth(ACME_KEY))
        assert r.status_code == 400
        assert "not valid JSON" in r.json()["error"]["message"]
        r = await http.post(
            "/v1/chat/completions", json={**CHAT, "temperature": 9}, headers=_auth(ACME_KEY)
        )
        assert (r.status_code, r.json()["error"]["param"]) == (400, "temperature")
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        r = await http.post("/v1/chat/completions", json=big, headers=_auth(ACME_KEY))
        assert r.status_code == 413
        assert "BRIGADE_EDGE_MAX_BODY" in r.json()["error"]["message"]
        headers = {**_auth(ACME_KEY), "X-Padding": "p" * (20 << 10)}
        r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 431
        r = await http.post("/v1/chat/completions", json=CHAT, headers=_auth("k" * 2000))
        assert r.status_code == 401
        assert "longer than 1024" in r.json()["error"]["message"]


async def test_health_and_metrics_names(bus_config, tmp_path):
    async with (
        running_edge(bus_config, keyring_for_tests(tmp_path)) as edge,
        httpx.AsyncClient(base_url=edge.url) as http,
    ):
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        r = await http.get("/health")  # live, but no engine worker pulls: not ready
        assert (r.status_code, r.json()["error"]["code"]) == (503, "unavailable")
        assert "no engine durable" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        text = (await http.get("/metrics")).text
        for name in (
            "brigade:time_to_first_token_seconds_bucket",
            "brigade:inter_token_latency_seconds_bucket",
            "brigade:time_per_output_token_seconds_bucket",
            "brigade:e2e_request_latency_seconds_bucket",
            "brigade:request_queue_time_seconds_bucket",
            "brigade:request_prompt_tokens_bucket",
            "brigade:request_generation_tokens_bucket",
            "brigade:num_requests_running",
            "brigade:num_requests_waiting",
            "brigade:kv_cache_usage_perc",
        ):
            assert f"{name}{{" in text, name
        series = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert series and all(f'model_name="{MODEL}"' in line for line in series)
        assert f'time_to_first_token_seconds_bucket{{le="160.0",model_name="{MODEL}"}}' in text


async def test_another_tenants_run_is_not_found(bus_config, tmp_path):
    bus = await Bus.connect(bus_config)
    try:
        async with (
            running_edge(bus_config, keyring_for_tests(tmp_path)) as edge,
            httpx.AsyncClient(base_url=edge.url) as http,
        ):
            await bus.publish(
                RequestAuthorized(
                    request_id="globexrun", tenant="globex", request=Request(messages=[])
                )
            )
            for path in ("/v1/runs/globexrun", "/v1/runs/globexrun/stream", "/v1/runs/nosuchrun"):
                r = await http.get(path, headers=_auth(ACME_KEY))
                assert r.status_code == 404, path
            r = await http.get("/v1/runs/globexrun", headers=_auth(GLOBEX_KEY))
            assert (r.status_code, r.json()["state"]) == (200, "queued")
            r = await http.get("/v1/runs/bad.id", headers=_auth(GLOBEX_KEY))
            assert r.status_code in (400, 404)

            async with websockets.connect(edge.ws_url, additional_headers=_auth(ACME_KEY)) as ws:
                for frame in (
                    {"type": "response.cancel", "request_id": "globexrun"},
                    {"type": "response.resume", "request_id": "globexrun", "starting_after": 0},
                ):
                    await ws.send(json.dumps(frame))
                    reply = json.loads(await ws.recv())
                    assert (reply["type"], reply["error"]["code"]) == ("error", "not_found")
        # the refused cancel published nothing
        info = await bus.js.stream_info(subjects.EVENTS_STREAM)
        assert info.state.messages == 1
    finally:
        await bus.close()


async def test_websocket_refuses_bad_keys_and_frames(bus_config, tmp_path):
    async with running_edge(bus_config, keyring_for_tests(tmp_path), max_frame_bytes=4096) as edge:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(edge.ws_url):
                pass
        assert info.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(edge.ws_url, additional_headers=_auth("nope")):
                pass
        assert info.value.response.status_code == 401
        assert b"nope" not in info.value.response.body
        assert len(info.value.response.headers["X-Request-Id"]) == 32
        assert json.loads(info.value.response.body)["error"]["code"] == "unauthorized"

        async with websockets.connect(edge.ws_url, additional_headers=_auth(ACME_KEY)) as ws:
            await ws.send("{not json")
            err = json.loads(await ws.recv())
            assert (err["type"], err["error"]["code"]) == ("error", "invalid_request")
            await ws.send(json.dumps({"type": "response.explode"}))
            assert json.loads(await ws.recv())["error"]["field"] == "type"
            await ws.send(
                json.dumps({"type": "response.create", "response": {"prompt": "x", "top_p": 7}})
            )
            assert json.loads(await ws.recv())["error"]["field"] == "top_p"
            await ws.send(
                json.dumps({"type": "response.create", "response": {"prompt": "x", "api_key": "k"}})
            )
            assert json.loads(await ws.recv())["error"]["field"] == "response.api_key"
            await ws.send(json.dumps({"type": "response.create", "response": {}}))
            assert "exactly one of" in json.loads(await ws.recv())["error"]["message"]
            await ws.send(b"\x00binary")
            assert "binary frames" in json.loads(await ws.recv())["error"]["message"]
            await ws.send("y" * 5000)
            err = json.loads(await ws.recv())
            assert (err["error"]["code"], "BRIGADE_EDGE_MAX_FRAME" in err["error"]["message"]) == (
                "too_large",
                True,
            )
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1009


async def test_websocket_resume_query_is_checked(bus_config, tmp_path):
    async with running_edge(bus_config, keyring_for_tests(tmp_path)) as edge:
        auth = _auth(ACME_KEY)
        url = f"{edge.ws_url}?request_id=nosuchrun&starting_after=3"
        async with websockets.connect(url, additional_headers=auth) as ws:
            err = json.loads(await ws.recv())
            assert (err["type"], err["error"]["code"]) == ("error", "not_found")
        async with websockets.connect(
            f"{edge.ws_url}?request_id=x&starting_after=abc", additional_headers=auth
        ) as ws:
            assert json.loads(await ws.recv())["error"]["field"] == "starting_after"


async def test_a_port_in_use_fails_the_start_and_leaves_no_connection(
    bus_config, nats_server, tmp_path
):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ready = anyio.Event()
        with pytest.raises(Exception) as info:  # noqa: PT011 - checked below, group or not
            await serve(
                config=bus_config,
                stop=anyio.Event(),
                ready=ready,
                edge_config=EdgeConfig(host="127.0.0.1", port=port),
                keys=keyring_for_tests(tmp_path),
                handle_signals=False,
            )
    errors = info.value.exceptions if isinstance(info.value, BaseExceptionGroup) else [info.value]
    while any(isinstance(e, BaseExceptionGroup) for e in errors):
        errors = [x for e in errors for x in getattr(e, "exceptions", [e])]
    assert [str(e) for e in errors] == [f"edge could not listen on 127.0.0.1:{port}"]
    assert not ready.is_set()
    # the server's monitor shows a closed connection a moment later (and the test before may
    # have left its own edge connection closing): wait for none, within a bound
    with anyio.fail_after(5):
        while connected(nats_server.monitor_url, "edge") is not False:
            await anyio.sleep(0.05)
