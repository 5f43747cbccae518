"""The event log's storage: the archiver to hourly Parquet, and the run-state projection in KV."""
