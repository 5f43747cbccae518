"""Wire events: every type round-trips as tagged JSON; bad input names the field and the limit."""

from __future__ import annotations

import msgspec
import pytest

from schemas.events import (
    EVENT_TYPES,
    Message,
    PromptTokenized,
    Request,
    RequestAccepted,
    RequestFailed,
    Sampling,
    TokenLogprob,
    TokensGenerated,
    Usage,
    decode_event,
    decode_submit,
    decoder_for,
    encode,
)


def test_every_event_type_has_a_distinct_past_tense_tag():
    assert sorted(EVENT_TYPES) == sorted(
        [
            "accepted",
            "authorized",
            "assembled",
            "tokenized",
            "started",
            "tokens",
            "finished",
            "text",
            "cancel",
            "completed",
            "cancelled",
            "failed",
            "billed",
            "doc_submitted",
            "doc_added",
            "doc_rejected",
            "doc_deleted",
            "collection_deleted",
        ]
    )


def test_tokens_event_round_trips_with_its_tag_and_compact_logprobs():
    event = TokensGenerated(
        request_id="r-1",
        tenant="acme",
        ts_ns=5,
        seq=3,
        token_ids=[17, 42],
        context_token_ids=[9],
        logprobs=[[TokenLogprob(17, -0.25), TokenLogprob(8, -1.5)]],
    )
    data = encode(event)
    assert data.startswith(b'{"type":"tokens","seq":3,"token_ids":[17,42]')
    assert b'"logprobs":[[[17,-0.25],[8,-1.5]]]' in data
    assert b"stop" not in data  # defaults are omitted: a token delta stays small
    assert decode_event(data) == event


def test_accepted_event_carries_the_normalized_request_not_the_key():
    request = Request(
        messages=[Message("user", "hi")], sampling=Sampling(temperature=0.0, max_tokens=4)
    )
    event = RequestAccepted(request_id="r-2", request=request, key_hash="sha256:ab")
    back = decode_event(encode(event))
    assert back == event
    assert back.request.sampling.max_tokens == 4 and back.request.sampling.top_p == 1.0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"prompt": "hi", "top_p": 7}', "Expected `float` <= 1.0 - at `$.top_p`"),
        (b'{"prompt": "hi", "temperature": -1}', "Expected `float` >= 0.0 - at `$.temperature`"),
        (b'{"prompt": "hi", "max_tokens": 0}', "Expected `int` >= 1 - at `$.max_tokens`"),
        (b'{"prompt": 5}', "Expected `str | null`, got `int` - at `$.prompt`"),
        (b'{"request_id": "a.b", "prompt": "x"}', "at `$.request_id`"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "at `$.messages[0].role`"),
        (b'{"prompt": "hi", "stop": ["a", ""]}', "at `$.stop[1]`"),
    ],
)
def test_bad_submits_name_the_field_and_the_limit(payload: bytes, message: str):
    with pytest.raises(msgspec.ValidationError) as err:
        decode_submit(payload)
    assert message in str(err.value)


def test_unknown_event_type_is_refused_and_unknown_fields_are_ignored():
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'exploded'"):
        decode_event(b'{"type": "exploded", "request_id": "r"}')
    event = decode_event(b'{"type": "cancel", "request_id": "r", "future_field": 1}')
    assert event.request_id == "r" and event.reason == "client"


def test_the_engines_compute_rate_is_optional_on_tokens_and_finished():
    """Events stored before the engine reported its rate decode with none; a rate goes on the
    wire only when there is one."""
    old = decode_event(b'{"type": "tokens", "request_id": "r", "seq": 0, "token_ids": [5]}')
    assert isinstance(old, TokensGenerated) and old.compute_tok_s is None
    assert b"compute_tok_s" not in encode(old)
    done = decode_event(b'{"type": "finished", "request_id": "r", "finish_reason": "stop"}')
    assert done.compute_tok_s is None
    new = TokensGenerated(request_id="r", seq=1, token_ids=[6], compute_tok_s=833.3)
    assert decode_event(encode(new)).compute_tok_s == 833.3


def test_typed_decoder_accepts_only_its_events():
    decoder = decoder_for(PromptTokenized)
    ok = encode(PromptTokenized(request_id="r", prompt_token_ids=[1, 2]))
    assert decoder.decode(ok).prompt_token_ids == [1, 2]
    failed = encode(RequestFailed(request_id="r", stage="x", code="internal", message="m"))
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(failed)
    both = decoder_for(PromptTokenized, RequestFailed)
    assert isinstance(both.decode(failed), RequestFailed)


def test_usage_defaults_to_zero_and_is_always_written():
    assert Usage() == Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0)
    assert msgspec.json.decode(encode(Usage(prompt_tokens=3))) == {
        "prompt_tokens": 3,
        "completion_tokens": 0,
        "cached_tokens": 0,
    }


def test_a_request_id_with_a_newline_never_reaches_a_subject():
    with pytest.raises(msgspec.ValidationError, match=r"at `\$.request_id`"):
        decode_submit(b'{"request_id": "abc\\n", "prompt": "x"}')
