"""Every error the edge's app answers is OpenAI-shaped JSON with an X-Request-Id: Starlette's
own 404 and 405, an unhandled exception (500), and NATS errors, which are a 503 with Retry-After
whatever route they hit (the bus here raises them; no server runs)."""

import httpx
import nats.errors
import nats.js.errors
import pytest

from stages.edge.app import build_app
from stages.edge.core import Edge, EdgeConfig
from stages.runtime.bus import BusConfig
from stages.tokenize import tokenizer_for
from tests.stages.edge_harness import ACME_KEY, MODEL, keyring_for_tests

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class _Raises:
    """Every awaited method raises `exc` (a client of a NATS that is away)."""

    def __init__(self, exc: BaseException, **attributes) -> None:
        self._exc = exc
        self.__dict__.update(attributes)

    def __getattr__(self, name: str):
        async def call(*args, **kwargs):
            raise self._exc

        return call


class _Bus:
    def __init__(self, exc: BaseException) -> None:
        self.config = BusConfig(servers=("nats://127.0.0.1:1",))  # the edge reads its ack wait
        self.nc = _Raises(exc, is_connected=True)
        self.js = _Raises(exc)
        self.publish = _Raises(exc).publish


def _client(tmp_path, exc: BaseException) -> httpx.AsyncClient:
    edge = Edge(_Bus(exc), EdgeConfig(model=MODEL), keyring_for_tests(tmp_path))
    edge.tokenizer = tokenizer_for(MODEL)
    transport = httpx.ASGITransport(app=build_app(edge))
    return httpx.AsyncClient(transport=transport, base_url="http://edge")


def _is_openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert len(r.headers["x-request-id"]) == 32
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


async def test_starlettes_404_and_405_are_openai_errors(tmp_path):
    async with _client(tmp_path, RuntimeError("unused")) as http:
        _is_openai_error(await http.get("/v2/nothing"), 404, "not_found")
        r = await http.get("/v1/chat/completions", headers=AUTH)
        error = _is_openai_error(r, 405, "method_not_allowed")
        assert "GET is not allowed on /v1/chat/completions; allowed: POST" in error["message"]
        assert r.headers["allow"] == "POST"
        r = await http.get("/v1/models/gpt-4o", headers=AUTH)
        assert _is_openai_error(r, 404, "model_not_found")["param"] == "model"
        r = await http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}, headers=AUTH)
        error = _is_openai_error(r, 404, "model_not_found")
        assert error["type"] == "invalid_request_error" and MODEL in error["message"]
        r = await http.post("/v1/chat/completions", json=CHAT)
        _is_openai_error(r, 401, "unauthorized")


async def test_an_unhandled_exception_is_a_500_in_openai_shape(tmp_path, caplog):
    async with _client(tmp_path, ZeroDivisionError("secret detail")) as http:
        r = await http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    error = _is_openai_error(r, 500, "internal")
    assert error["type"] == "server_error"
    assert "secret detail" not in r.text
    assert r.headers["x-request-id"] in caplog.text  # the log holds it, under the same id


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.NoRespondersError(),
        nats.errors.TimeoutError(),
        nats.errors.ConnectionClosedError(),
        nats.errors.ConnectionReconnectingError(),
        nats.js.errors.ServiceUnavailableError(code=503, description="JetStream unavailable"),
        nats.js.errors.APIError(code=500, err_code=10008, description="leader election"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_nats_errors_are_503_with_retry_after_on_every_route(tmp_path, exc):
    async with _client(tmp_path, exc) as http:
        answers = [
            await http.post("/v1/chat/completions", json=CHAT, headers=AUTH),
            await http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH),
            await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=AUTH),
            await http.get("/v1/runs/somerun", headers=AUTH),
            await http.get("/v1/runs/somerun/stream", headers=AUTH),
            await http.get("/health"),
        ]
    for r in answers:
        _is_openai_error(r, 503, "unavailable")
        assert r.headers["retry-after"] == "1"


async def test_health_is_503_until_an_engine_pulls(tmp_path):
    async with _client(tmp_path, nats.js.errors.NotFoundError()) as http:
        r = await http.get("/health")
    error = _is_openai_error(r, 503, "unavailable")
    assert "no engine durable" in error["message"]
    assert r.headers["retry-after"] == "1"


async def test_tokenize_and_detokenize_as_vllm_answers(tmp_path):
    tok = tokenizer_for(MODEL)
    async with _client(tmp_path, RuntimeError("unused")) as http:
        r = await http.post("/tokenize", json={"prompt": "Hello world"}, headers=AUTH)
        body = r.json()
        assert body["tokens"] == tok.encode("Hello world")
        assert (body["count"], body["max_model_len"], body["token_strs"]) == (
            len(body["tokens"]), tok.max_model_len, None)  # fmt: skip
        messages = [{"role": "user", "content": "hi"}]
        r = await http.post(
            "/tokenize",
            json={"model": MODEL, "messages": messages, "return_token_strs": True},
            headers=AUTH,
        )
        assert r.json()["tokens"] == tok.encode_chat(messages, add_generation_prompt=True)
        assert len(r.json()["token_strs"]) == r.json()["count"]
        r = await http.post("/detokenize", json={"tokens": tok.encode("Hello")}, headers=AUTH)
        assert r.json() == {"prompt": "Hello"}
        r = await http.post("/detokenize", json={"tokens": [1, 10**9]}, headers=AUTH)
        assert _is_openai_error(r, 400, "invalid_request")["param"] == "tokens[1]"
        r = await http.post("/tokenize", json={"prompt": "x", "model": "gpt-4o"}, headers=AUTH)
        _is_openai_error(r, 404, "model_not_found")
        r = await http.post("/tokenize", json={"prompt": 3}, headers=AUTH)
        assert _is_openai_error(r, 400, "invalid_request")["param"] == "prompt"
        r = await http.post("/tokenize", content=b"{no", headers=AUTH)
        _is_openai_error(r, 400, "invalid_request")
        r = await http.get("/version")
        assert r.json()["version"]


class _Consumer:
    def __init__(self, num_waiting: int, num_ack_pending: int) -> None:
        self.num_waiting, self.num_ack_pending = num_waiting, num_ack_pending


@pytest.mark.parametrize(("waiting", "pending", "status"), [(0, 0, 503), (1, 0, 200), (0, 2, 200)])
async def test_health_follows_the_engine_durable(tmp_path, waiting, pending, status):
    edge = Edge(_Bus(RuntimeError("unused")), EdgeConfig(model=MODEL), keyring_for_tests(tmp_path))
    asked = []

    async def consumer_info(stream, durable):
        asked.append((stream, durable))
        return _Consumer(waiting, pending)

    edge.bus.js.consumer_info = consumer_info
    transport = httpx.ASGITransport(app=build_app(edge))
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
        r = await http.get("/health")
    assert r.status_code == status
    assert asked[0] == ("BRIGADE_EVENTS", f"brigade-engine-{MODEL}")  # the model's own durable


async def test_health_is_503_until_every_served_model_has_an_engine(tmp_path):
    """Two served models: 200 only while the durables of both have a worker pulling; the 503
    names the model that has none."""
    config = EdgeConfig(model=f"{MODEL},tiny={MODEL}")
    edge = Edge(_Bus(RuntimeError("unused")), config, keyring_for_tests(tmp_path))
    pulling = {f"brigade-engine-{MODEL}": 1}

    async def consumer_info(stream, durable):
        return _Consumer(pulling.get(durable, 0), 0)

    edge.bus.js.consumer_info = consumer_info
    transport = httpx.ASGITransport(app=build_app(edge))
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
        r = await http.get("/health")
        error = _is_openai_error(r, 503, "unavailable")
        assert (
            "no engine worker of 'tiny' is pulling from 'brigade-engine-tiny'" in error["message"]
        )
        pulling["brigade-engine-tiny"] = 2
        r = await http.get("/health")
        assert r.status_code == 200
        assert (
            r.json()["detail"]
            == f"{MODEL}: 1 engine pull request(s) waiting; tiny: 2 engine pull request(s) waiting"
        )
