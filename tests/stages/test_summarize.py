"""Summarize helpers: the nested run's id and the transcript it is asked to summarize.

The run itself is tested through the bus: the fallback in test_context.py, the engine's summary
in test_pipeline.py.
"""

from __future__ import annotations

import re

from schemas.events import Message
from schemas.subjects import REQUEST_ID_PATTERN
from stages.summarize import nested_request_id, transcript


def test_nested_request_id_is_deterministic_and_a_valid_id() -> None:
    assert nested_request_id("abc") == "abc-sum"
    long = "x" * 64
    nested = nested_request_id(long)
    assert nested == nested_request_id(long) and nested.startswith("sum-") and len(nested) == 44
    assert re.match(REQUEST_ID_PATTERN, nested) and nested != nested_request_id("y" * 64)


def test_transcript_names_each_speaker() -> None:
    messages = [Message(role="user", content="Hi"), Message(role="assistant", content="Hello!")]
    assert transcript(messages) == "user: Hi\nassistant: Hello!"
