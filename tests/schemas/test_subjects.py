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
