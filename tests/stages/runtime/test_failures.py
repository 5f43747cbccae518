"""Failure helpers: the field a msgspec error names, the request id inside bad input."""

from __future__ import annotations

from stages.runtime.failures import (
    bus_away_delay_s,
    bus_away_span_s,
    error_field,
    read_envelope,
)


def test_error_field_reads_msgspec_paths() -> None:
    assert error_field(ValueError("Expected `float` <= 1.0 - at `$.top_p`")) == "top_p"
    assert error_field(ValueError("Object missing required field `request`")) == "request"
    missing_role = ValueError("Object missing required field `role` - at `$.messages[0]`")
    assert error_field(missing_role) == "messages[0].role"
    assert error_field(ValueError("JSON is malformed: invalid character (byte 0)")) is None
    bad_key = ValueError("Expected `int` >= 0 - at `key` in `$.logit_bias`")  # a dict's key
    assert error_field(bad_key) == "logit_bias"


def test_read_envelope_keeps_only_valid_ids() -> None:
    assert read_envelope(b'{"request_id": "r-1", "tenant": "acme", "x": [1]}') == ("r-1", "acme")
    assert read_envelope(b'{"request_id": "a.b.>", "tenant": 5}') == (None, None)
    assert read_envelope(b'{"request_id": 7}') == (None, None)
    assert read_envelope(b"\xff garbage") == (None, None)
    assert read_envelope(b"[1, 2]") == (None, None)


def test_a_duckdb_file_another_process_has_is_busy_and_other_errors_are_not():
    from stages.runtime.failures import duckdb_file_busy

    assert duckdb_file_busy(OSError('IO Error: Could not set lock on file "x.duckdb"'))
    assert duckdb_file_busy(
        OSError('IO Error: The file "x.duckdb" exists, but it is not a valid DuckDB database file!')
    )
    assert not duckdb_file_busy(OSError("IO Error: Permission denied"))


def test_a_message_handed_back_while_the_bus_is_away_waits_1_2_4_8_s_up_to_30():
    assert [bus_away_delay_s(d) for d in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert bus_away_span_s(5) == 15.0  # the default five deliveries: an election or a restart
    assert bus_away_span_s(1) == 0.0  # one delivery: never handed back
