"""Subjects: one spelling for every name; request ids can never become more than one token."""

from __future__ import annotations

import re

import pytest

from schemas import subjects


def test_event_subjects_and_filters():
    assert subjects.event_subject("r-1", "tokens") == "llm.ev.r-1.tokens"
    assert subjects.request_events("r-1") == "llm.ev.r-1.>"
    assert subjects.all_events("authorized") == "llm.ev.*.authorized"
    assert subjects.ALL_EVENTS == "llm.ev.>"
    assert subjects.durable_name("tokenize") == "brigade-tokenize"


def test_msg_ids_dedupe_per_event_and_seq():
    assert subjects.msg_id("r-1", "accepted") == "r-1:accepted"
    assert subjects.msg_id("r-1", "tokens", 0) == "r-1:tokens:0"
    assert subjects.msg_id("r-1", "tokens", 0) != subjects.msg_id("r-1", "tokens", 1)


@pytest.mark.parametrize("request_id", ["abc", "A_9-z", "x" * 64])
def test_valid_request_ids(request_id: str):
    assert re.match(subjects.REQUEST_ID_PATTERN, request_id)


@pytest.mark.parametrize(
    "request_id", ["", "a.b", "a*", "a>", "a b", "x" * 65, "é", "abc\n", "a\r\nPUB x"]
)
def test_request_ids_that_would_break_a_subject_are_refused(request_id: str):
    assert not re.match(subjects.REQUEST_ID_PATTERN, request_id)


def test_a_routed_event_carries_its_models_token():
    assert subjects.event_subject("r-1", "tokenized", "tiny") == "llm.ev.r-1.tokenized.tiny"
    assert subjects.all_events("tokenized", "tiny") == "llm.ev.*.tokenized.tiny"
    assert subjects.routed_events("tokenized") == "llm.ev.*.tokenized.>"
    assert subjects.durable_name("engine", "tiny") == "brigade-engine-tiny"
    assert subjects.request_events("r-1") == "llm.ev.r-1.>"  # a run's events, routed ones too


@pytest.mark.parametrize(
    "model", ["Llama-3.2-1B", "/models/SmolLM2.Q4_1.gguf", "org/name", "a b", "x" * 200, "*", ">"]
)
def test_any_model_id_becomes_one_safe_token_of_its_own(model: str):
    token = subjects.model_token(model)
    assert re.match(r"^[A-Za-z0-9_-]{1,64}$", token), token
    assert token != subjects.model_token(model + "2")  # the digest keeps ids apart
    assert subjects.model_token("smollm2-135m") == "smollm2-135m"  # a safe id is its own token
