"""The event log's readers: DuckDB views, report, trace, replay, sql, plots and the SLA table."""
