"""Gateway: validation names the field, ids are assigned, keys are hashed, answers are sent."""

from __future__ import annotations

import hashlib

import anyio
import msgspec
import pytest

from schemas import settings, subjects
from schemas.events import RequestAccepted, RequestFailed, Submit, decode_event, decode_submit
from stages import auth, gateway
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus, BusConfig
from stages.tenancy import tenants


def submit_result(data: bytes) -> RequestAccepted | RequestFailed:
    try:
        submit = decode_submit(data)
    except msgspec.DecodeError as err:
        return gateway.invalid_submit(data, err)
    (out,) = gateway.handle(submit, None)
    return out


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        (
            b"{not json",
            None,
            "the submit is not valid JSON: JSON is malformed: object keys must be strings (byte 1)",
        ),
        (
            b'{"prompt": 5}',
            "prompt",
            "invalid submit field `prompt`: Expected `str | null`, got `int`",
        ),
        (
            b'{"prompt": "x", "top_p": 7}',
            "top_p",
            "invalid submit field `top_p`: Expected `float` <= 1.0",
        ),
        (
            b'{"prompt": "x", "max_tokens": "9"}',
            "max_tokens",
            "invalid submit field `max_tokens`: Expected `int`, got `str`",
        ),
        (
            b'{"messages": [{"role": "bot", "content": "x"}]}',
            "messages[0].role",
            "invalid submit field `messages[0].role`: Invalid enum value 'bot'",
        ),
        (b'{"messages": []}', "messages", "`messages` is empty; send at least one {role, content}"),
        (
            b"{}",
            "messages",
            "give `messages` (a list of {role, content}), `prompt` (a string) or "
            "`prompt_token_ids`; none was sent",
        ),
        (
            b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}',
            "prompt",
            "give one of `messages`, `prompt` and `prompt_token_ids`, not messages and prompt",
        ),
        (
            b'{"prompt": "a", "prompt_token_ids": [1, 2]}',
            "prompt_token_ids",
            "give one of `messages`, `prompt` and `prompt_token_ids`, not prompt and "
            "prompt_token_ids",
        ),
        (
            b'{"prompt_token_ids": [1], "documents": [{"content": "d"}]}',
            "documents",
            "`documents` needs `messages`: a raw `prompt` reaches the model as is",
        ),
        (
            b'{"prompt": "a", "system": "s"}',
            "system",
            "`system` needs `messages`: a raw `prompt` reaches the model as is",
        ),
        (
            b'{"prompt": "a", "max_tokens": 4, "min_tokens": 5}',
            "min_tokens",
            "min_tokens=5 is above max_tokens=4",
        ),
        (
            b'{"request_id": "a.b", "prompt": "x"}',
            "request_id",
            "invalid submit field `request_id`: Expected `str` matching regex '^[A-Za-z0-9_-]{1,64}(?!\\\\n)$'",
        ),
    ],
)
def test_bad_submits_fail_naming_the_field(data: bytes, field: str | None, message: str) -> None:
    out = submit_result(data)
    assert isinstance(out, RequestFailed)
    assert (out.stage, out.code, out.field, out.message) == (
        "gateway",
        "invalid_request",
        field,
        message,
    )
    assert len(out.request_id) == 32


def test_ten_megabyte_prompt_is_refused_with_sizes() -> None:
    data = b'{"request_id": "big1", "prompt": "' + b"a" * 10_000_000 + b'"}'
    out = submit_result(data)
    assert isinstance(out, RequestFailed) and out.request_id == "big1"
    assert out.message == (
        "invalid submit field `prompt`: Expected `str` of length <= 1000000 "
        "(the submit was 10000036 bytes)"
    )


def test_total_text_limit_counts_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.MAX_SUBMIT_CHARS.name, "10")
    out = submit_result(b'{"system": "12345", "messages": [{"role": "user", "content": "123456"}]}')
    assert isinstance(out, RequestFailed) and out.field == "messages"
    assert (
        out.message
        == "the submit holds 11 characters of text; the limit is 10 (BRIGADE_MAX_SUBMIT_CHARS)"
    )


def test_accepted_normalizes_and_hashes_the_key() -> None:
    out = submit_result(
        b'{"request_id": "mine-1", "api_key": "s3cret", "prompt": "Hi", "temperature": 0,'
        b' "max_tokens": 7, "stop": ["\\n"], "priority": "batch"}'
    )
    assert isinstance(out, RequestAccepted) and out.request_id == "mine-1"
    assert out.key_hash == "sha256:" + hashlib.sha256(b"s3cret").hexdigest()
    assert b"s3cret" not in msgspec.json.encode(out)
    r = out.request
    assert (r.raw_prompt, [(m.role, m.content) for m in r.messages]) == (True, [("user", "Hi")])
    assert (r.sampling.temperature, r.sampling.max_tokens, r.sampling.stop) == (0.0, 7, ["\n"])
    assert r.priority == "batch" and out.received_ns > 0
    ids = submit_result(b'{"prompt_token_ids": [5, 6, 7], "max_tokens": 2}')
    assert isinstance(ids, RequestAccepted)
    assert (ids.request.raw_prompt, ids.request.messages, ids.request.prompt_token_ids) == (
        True, [], [5, 6, 7])  # fmt: skip


def test_the_request_names_a_served_model_or_fails_model_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """None: the default (BRIGADE_MODEL's first); an id: that model; any other name fails at
    once, naming what is served, rather than waiting for an engine nobody runs."""
    monkeypatch.setenv("BRIGADE_MODEL", "smollm2-135m,tiny=/models/tiny")
    default = submit_result(b'{"prompt": "Hi"}')
    tiny = submit_result(b'{"prompt": "Hi", "model": "tiny"}')
    assert isinstance(default, RequestAccepted) and isinstance(tiny, RequestAccepted)
    assert (default.request.model, tiny.request.model) == ("smollm2-135m", "tiny")
    for name in ("gpt-4o", "/models/tiny"):  # an artifact is not an id
        out = submit_result(b'{"prompt": "Hi", "model": "' + name.encode() + b'"}')
        assert isinstance(out, RequestFailed)
        assert (out.code, out.field, out.stage) == ("model_not_found", "model", "gateway")
        assert out.message == f"the model {name!r} is not served here; served: smollm2-135m, tiny"


@pytest.mark.anyio
async def test_gateway_answers_on_the_reply_inbox(bus_config: BusConfig) -> None:
    stop, ready = anyio.Event(), anyio.Event()
    bus = await Bus.connect(bus_config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: runtime.serve(
                gateway.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        ok = await bus.submit(Submit(request_id="r-ok", prompt="Hi", api_key="k"))
        bad = await bus.submit(b'{"request_id": "r-bad", "prompt": "x", "top_p": 7}')
        junk = await bus.submit(b"\x00\x01")
        stop.set()
    assert (ok.request_id, ok.accepted) == ("r-ok", True)
    assert (bad.request_id, bad.accepted, bad.code, bad.field) == (
        "r-bad",
        False,
        "invalid_request",
        "top_p",
    )
    assert junk.accepted is False and junk.message.startswith("the submit is not valid JSON")
    (accepted,) = await bus.replay("r-ok")
    assert isinstance(accepted, RequestAccepted) and accepted.service_ns > 0
    (failed,) = await bus.replay(junk.request_id)
    assert isinstance(failed, RequestFailed) and failed.stage == "gateway"
    info = await bus.js.stream_info("BRIGADE_IN")
    assert info.state.messages == 0  # the work queue is empty: every submit was acked
    await bus.close()


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        (
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "p",'
            b' "schema": {"type": "objekt"}, "strict": true}}',
            "response_format.json_schema",
            "Invalid type: objekt",
        ),
        (b'"guided_regex": "(("', "guided_regex", "unclosed group"),
        (b'"guided_grammar": "start: foo"', "guided_grammar", 'unknown name: "foo"'),
        (b'"guided_json": "{nope"', "guided_json", "not valid JSON"),
        (b'"guided_regex": "a", "guided_choice": ["b"]', "guided_choice", "at most one"),
        (b'"response_format": {"type": "json_schema"}', "response_format.json_schema", "needs"),
    ],
)
def test_a_structured_output_that_cannot_compile_fails_naming_the_problem(
    body: bytes, field: str, problem: str
) -> None:
    out = submit_result(b'{"prompt": "x", ' + body + b"}")
    assert isinstance(out, RequestFailed), out
    assert (out.code, out.field) == ("invalid_request", field)
    assert problem in out.message


def test_structured_output_fields_reach_the_request() -> None:
    out = submit_result(
        b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema":'
        b' {"name": "p", "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}}'
    )
    assert isinstance(out, RequestAccepted)
    schema = out.request.sampling.response_format.json_schema.schema
    assert list(schema["properties"]) == ["b", "a"]  # the order properties are generated in
    out = submit_result(b'{"prompt": "x", "guided_choice": ["yes", "no"]}')
    assert isinstance(out, RequestAccepted) and out.request.sampling.guided_choice == ["yes", "no"]


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        (b'"stop_token_ids": [1180591620717411303424]', "stop_token_ids[0]", "<= 1048575"),
        (b'"stop_token_ids": [2, -1]', "stop_token_ids[1]", ">= 0"),
        (b'"top_k": 1180591620717411303424', "top_k", "<= 1048576"),
        (b'"seed": 18446744073709551616', "seed", "<= 9223372036854775807"),
        (b'"max_tokens": 1180591620717411303424', "max_tokens", "<= 8192"),
        (b'"logprobs": 21', "logprobs", "<= 20"),
    ],
)
def test_integers_are_bounded_by_name(body: bytes, field: str, problem: str) -> None:
    out = submit_result(b'{"prompt": "x", ' + body + b"}")
    assert isinstance(out, RequestFailed), out
    assert (out.code, out.field) == ("invalid_request", field)
    assert problem in out.message


def test_deep_json_fails_naming_the_field_and_keeps_the_request_id() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    out = submit_result(b'{"request_id": "deep-1", "prompt": "x", "stop": ' + deep + b"}")
    assert isinstance(out, RequestFailed) and out.request_id == "deep-1"
    assert out.field == "stop[0][0][0][0][0]"
    assert out.message.startswith(
        "invalid submit field `stop[0][0][0][0][0]`: JSON nested deeper than 64 levels"
    )
    truncated = submit_result(b'{"request_id": "deep-2", "documents": ' + b"{" * 5000)
    assert isinstance(truncated, RequestFailed) and truncated.field == "documents"


def test_a_schema_nested_past_the_value_bound_is_refused_by_name() -> None:
    schema = {"type": "array", "items": {}}
    inner = schema
    for _ in range(40):  # one level each: 42 with the outer and the innermost {}
        inner["items"] = {"type": "array", "items": {}}
        inner = inner["items"]
    body = msgspec.json.encode({"prompt": "x", "guided_json": schema})
    out = submit_result(body)
    assert isinstance(out, RequestFailed) and out.field == "guided_json"
    assert out.message == "`guided_json` nests 42 levels of JSON; at most 32 are taken"
    as_text = msgspec.json.encode({"prompt": "x", "guided_json": body.decode()})
    assert submit_result(as_text).field == "guided_json"
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    out = submit_result(msgspec.json.encode({"prompt": "x", "response_format": fmt}))
    assert isinstance(out, RequestFailed) and out.field == "response_format.json_schema.schema"


@pytest.mark.anyio
async def test_llm_in_fuzzer_every_bad_submit_is_named_and_the_gateway_lives(
    bus_config: BusConfig,
) -> None:
    """341 seeded bad submits through a real nats-server and the real gateway stage: each gets
    a reply (and its failed event) naming the field; then a normal submit is still accepted."""
    from tests.schemas.submit_fuzz import bad_cases, names

    cases = list(bad_cases(seed=11))
    assert len(cases) >= 300
    stop, ready = anyio.Event(), anyio.Event()
    bus = await Bus.connect(bus_config)
    replies: dict[int, object] = {}
    limit = anyio.Semaphore(16)

    async def send(i: int, data: bytes) -> None:
        async with limit:
            replies[i] = await bus.submit(data, timeout_s=30)

    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: runtime.serve(
                gateway.SPEC, config=bus_config, stop=stop, ready=ready, handle_signals=False
            )
        )
        await ready.wait()
        async with anyio.create_task_group() as senders:
            for i, case in enumerate(cases):
                senders.start_soon(send, i, case.submit())
        ok = await bus.submit(Submit(request_id="after-fuzz", prompt="Hi"))
        kept = await bus.submit(  # a client's own id survives a deep value after it
            b'{"request_id": "fuzz-own-id", "prompt": "x", "stop": '
            + b"[" * 5000
            + b"]" * 5000
            + b"}"
        )
        stop.set()
    wrong = [
        (c.field, c.value[:40], r.field, r.message[:80])
        for c, r in ((cases[i], replies[i]) for i in range(len(cases)))
        if r.accepted or r.code != "invalid_request" or not names(r.field, c.field)
    ]
    assert not wrong, wrong
    assert (ok.request_id, ok.accepted) == ("after-fuzz", True)
    assert (kept.request_id, kept.field) == ("fuzz-own-id", "stop[0][0][0][0][0]")
    for i in range(0, len(cases), 60):  # the failed events are in the log, naming the field
        (failed,) = await bus.replay(replies[i].request_id)
        assert isinstance(failed, RequestFailed) and failed.field == replies[i].field
    info = await bus.js.stream_info("BRIGADE_IN")
    assert info.state.messages == 0
    await bus.close()


KEY_A = "brg-owner-a-test-key-000000000000"
KEY_B = "brg-owner-b-test-key-000000000000"


def _two_tenants(tmp_path, monkeypatch) -> None:
    path = tmp_path / "tenants.toml"
    tenants.add_key("tenant-a", path=path, api_key=KEY_A)
    tenants.add_key("tenant-b", path=path, api_key=KEY_B)
    monkeypatch.setenv("BRIGADE_TENANTS", str(path))


async def _owner_of(bus: Bus, request_id: str) -> str | None:
    """What the edge reads for attach, resume and cancel: the last `authorized` event's tenant."""
    subject = subjects.event_subject(request_id, "authorized")
    msg = await bus.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
    return decode_event(msg.data).tenant


async def _stored(bus: Bus, request_id: str) -> list[str]:
    return [type(e).__struct_config__.tag for e in await bus.replay(request_id)]


@pytest.mark.anyio
async def test_a_request_id_belongs_to_its_tenant(bus_config: BusConfig, tmp_path, monkeypatch):
    """Tenant B submitting tenant A's request id through llm.in is refused, inside the dedupe
    window (where B's `accepted` used to be dropped as a duplicate although B's reply said
    accepted: the vanishing run) and past it (where B's run took A's over: B became the owner the
    edge reads, so B read A's text and A was locked out). Nothing is stored under A's id."""
    _two_tenants(tmp_path, monkeypatch)
    stop = anyio.Event()
    bus = await Bus.connect(bus_config)
    try:
        async with anyio.create_task_group() as tg:
            for spec in (gateway.SPEC, auth.SPEC):
                ready = anyio.Event()
                tg.start_soon(
                    lambda s=spec, r=ready: runtime.serve(
                        s, config=bus_config, stop=stop, ready=r, handle_signals=False
                    )
                )
                await ready.wait()
            mine = Submit(request_id="shared-1", prompt="A's question", api_key=KEY_A)
            assert (await bus.submit(mine)).accepted
            with anyio.fail_after(5):
                while "authorized" not in await _stored(bus, "shared-1"):
                    await anyio.sleep(0.05)
            before = await _stored(bus, "shared-1")

            theirs = Submit(request_id="shared-1", prompt="B's question", api_key=KEY_B)
            inside = await bus.submit(theirs)  # inside the dedupe window
            again = await bus.submit(mine)  # a repeat of A's own submit (a redelivery) is A's
            reused = await bus.submit(  # A's id with another body would vanish: refused
                msgspec.structs.replace(mine, prompt="A's second question")
            )
            # past it: the stream forgets the msg ids, so only the claim can refuse B
            info = await bus.js.stream_info(subjects.EVENTS_STREAM)
            info.config.duplicate_window = 0.5
            await bus.js.update_stream(info.config)
            await anyio.sleep(0.7)
            past = await bus.submit(theirs)
            bad_key = await bus.submit(
                Submit(request_id="shared-1", prompt="x", api_key="brg-not-a-key")
            )
            invalid = await bus.submit(  # even a submit that would fail stores nothing there
                Submit(request_id="shared-1", prompt="x", api_key=KEY_B, min_tokens=9, max_tokens=1)
            )
            undecodable = await bus.submit(  # nor one that does not decode (no tenant to check)
                b'{"request_id": "shared-1", "prompt": 5, "api_key": "%s"}' % KEY_B.encode()
            )
            await anyio.sleep(0.3)
            stop.set()
        for refused in (inside, reused, past, bad_key, invalid):
            assert (refused.accepted, refused.code, refused.field) == (
                False,
                "conflict",
                "request_id",
            )
            assert refused.request_id != "shared-1" and "shared-1" in refused.message
            (failed,) = await bus.replay(refused.request_id)  # the refusal lives under its own id
            assert isinstance(failed, RequestFailed) and failed.stage == "gateway"
        assert (undecodable.accepted, undecodable.field) == (False, "prompt")
        assert undecodable.request_id != "shared-1" and "'shared-1' belongs" in undecodable.message
        (failed,) = await bus.replay(undecodable.request_id)
        assert isinstance(failed, RequestFailed) and failed.field == "prompt"
        assert again.accepted and again.request_id == "shared-1"
        assert await _stored(bus, "shared-1") == before  # A's retry was a stored duplicate
        assert await _owner_of(bus, "shared-1") == "tenant-a"
        # a fresh id is B's own
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                ready = anyio.Event()
                stop = anyio.Event()
                tg.start_soon(
                    lambda: runtime.serve(
                        gateway.SPEC,
                        config=bus_config,
                        stop=stop,
                        ready=ready,
                        handle_signals=False,
                    )
                )
                await ready.wait()
                own = await bus.submit(Submit(request_id="b-own-1", prompt="B", api_key=KEY_B))
                stop.set()
        assert (own.accepted, own.request_id) == (True, "b-own-1")
    finally:
        await bus.close()
