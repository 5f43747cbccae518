-- Views over the event log. `events` (one row per stored message, columns in schemas/logrows.py)
-- is created by tools/log/views.py; everything here derives from it. Times: *_ns are wall-clock
-- nanoseconds (ts_ns = when the event was published), *_ms are durations in milliseconds.

-- One row per fact: a redelivered publish that escaped JetStream's dedupe window is counted once.
CREATE OR REPLACE VIEW ev AS
SELECT * EXCLUDE (dup_rank)
FROM (
    SELECT *, row_number() OVER (
        PARTITION BY request_id, type, coalesce(seq, -1) ORDER BY stream_seq) AS dup_rank
    FROM events
)
WHERE dup_rank = 1;

-- When each request arrived: the gateway's receipt of the submit, or the start of its work on
-- it when that is earlier (a gateway that stamps receipt inside its handler).
CREATE OR REPLACE VIEW arrivals AS
WITH acc AS (
    SELECT request_id,
           least(coalesce(nullif(TRY_CAST(data ->> '$.received_ns' AS BIGINT), 0), ts_ns),
                 ts_ns - service_ns) AS arrival_ns
    FROM ev WHERE type = 'accepted'
), first_seen AS (
    SELECT request_id, min(ts_ns - service_ns) AS first_ns, max(tenant) AS tenant
    FROM ev GROUP BY request_id
)
SELECT f.request_id, f.tenant, coalesce(a.arrival_ns, f.first_ns) AS arrival_ns
FROM first_seen f LEFT JOIN acc a USING (request_id);

-- Per request: status, tokens in/out, TTFT, inter-token latency, time per output token, E2E.
-- TTFT counts to the first non-empty text delta (what a client sees); engine_ttft_ms to the
-- engine's first `tokens` event. tpot_ms = (e2e - ttft) / (tokens out - 1); tps = 1000 / tpot_ms.
CREATE OR REPLACE VIEW requests AS
WITH tokd AS (
    SELECT request_id, json_array_length(data, '$.prompt_token_ids') AS num_prompt_ids
    FROM ev WHERE type = 'tokenized'
), toks AS (
    SELECT request_id, min(ts_ns) AS first_token_ns, sum(num_tokens) AS num_tokens
    FROM ev WHERE type = 'tokens' GROUP BY request_id
), txt AS (
    SELECT request_id, min(ts_ns) AS first_text_ns, max(ts_ns) AS last_text_ns,
           count(*) AS num_deltas
    FROM ev WHERE type = 'text' AND text <> '' GROUP BY request_id
), fin AS (
    SELECT request_id,
           data ->> '$.finish_reason' AS finish_reason,
           TRY_CAST(data ->> '$.usage.prompt_tokens' AS BIGINT) AS prompt_tokens,
           TRY_CAST(data ->> '$.usage.completion_tokens' AS BIGINT) AS completion_tokens,
           TRY_CAST(data ->> '$.usage.cached_tokens' AS BIGINT) AS cached_tokens,
           coalesce(TRY_CAST(data ->> '$.queue_ns' AS BIGINT), 0) AS admission_ns,
           coalesce(TRY_CAST(data ->> '$.prefill_ns' AS BIGINT), 0) AS prefill_ns,
           coalesce(TRY_CAST(data ->> '$.decode_ns' AS BIGINT), 0) AS decode_ns,
           TRY_CAST(data ->> '$.seed' AS BIGINT) AS seed
    FROM ev WHERE type = 'finished'
), term AS (
    SELECT request_id,
           arg_min(type, stream_seq) AS status,
           arg_min(ts_ns, stream_seq) AS end_ns,
           arg_min(data, stream_seq) AS term_data
    FROM ev WHERE type IN ('completed', 'cancelled', 'failed') GROUP BY request_id
), base AS (
    SELECT a.request_id, a.tenant, a.arrival_ns, t.status, t.end_ns,
           coalesce(f.finish_reason, t.term_data ->> '$.finish_reason') AS finish_reason,
           CASE WHEN t.status = 'failed' THEN t.term_data ->> '$.code' END AS error_code,
           CASE WHEN t.status = 'failed' THEN t.term_data ->> '$.stage' END AS error_stage,
           CASE WHEN t.status = 'failed' THEN t.term_data ->> '$.message' END AS error_message,
           coalesce(nullif(f.prompt_tokens, 0), d.num_prompt_ids, 0) AS tokens_in,
           coalesce(nullif(f.completion_tokens, 0), k.num_tokens, 0) AS tokens_out,
           f.cached_tokens, f.seed,
           k.first_token_ns, x.first_text_ns, x.last_text_ns, x.num_deltas,
           f.admission_ns, f.prefill_ns, f.decode_ns
    FROM arrivals a
    LEFT JOIN term t USING (request_id)
    LEFT JOIN fin f USING (request_id)
    LEFT JOIN tokd d USING (request_id)
    LEFT JOIN toks k USING (request_id)
    LEFT JOIN txt x USING (request_id)
)
SELECT *,
       (first_text_ns - arrival_ns) / 1e6 AS ttft_ms,
       (first_token_ns - arrival_ns) / 1e6 AS engine_ttft_ms,
       (end_ns - arrival_ns) / 1e6 AS e2e_ms,
       CASE WHEN num_deltas > 1
            THEN (last_text_ns - first_text_ns) / 1e6 / (num_deltas - 1) END AS itl_ms,
       CASE WHEN tokens_out > 1 AND first_text_ns IS NOT NULL AND end_ns IS NOT NULL
            THEN (end_ns - first_text_ns) / 1e6 / (tokens_out - 1) END AS tpot_ms,
       CASE WHEN tokens_out > 1 AND end_ns > first_text_ns
            THEN 1e3 * (tokens_out - 1) / ((end_ns - first_text_ns) / 1e6) END AS tps
FROM base;

-- Inter-token latency samples: the gap before each non-empty text delta after the first.
CREATE OR REPLACE VIEW token_gaps AS
SELECT request_id, tenant, seq, ts_ns,
       (ts_ns - lag(ts_ns) OVER (PARTITION BY request_id ORDER BY seq)) / 1e6 AS gap_ms
FROM ev WHERE type = 'text' AND text <> '';

-- One row per stage hop: the input event's publish (in_ns), the stage's start (end - service)
-- and its output's publish (end_ns). queue_ns = start - in: bus transit plus waiting for a worker
-- (for the engine: plus waiting for admission). Streamed stages have one hop per seq.
CREATE OR REPLACE VIEW stage_hops AS
WITH hop(stage, stage_order, in_type, out_type) AS (
    VALUES ('auth', 2, 'accepted', 'authorized'),
           ('context', 3, 'authorized', 'assembled'),
           ('tokenize', 4, 'assembled', 'tokenized')
), fin AS (
    SELECT request_id, ts_ns,
           coalesce(nullif(coalesce(TRY_CAST(data ->> '$.prefill_ns' AS BIGINT), 0)
                           + coalesce(TRY_CAST(data ->> '$.decode_ns' AS BIGINT), 0), 0),
                    service_ns) AS engine_ns
    FROM ev WHERE type = 'finished'
), term AS (
    SELECT request_id, arg_min(ts_ns, stream_seq) AS ts_ns
    FROM ev WHERE type IN ('completed', 'cancelled', 'failed') GROUP BY request_id
), hops AS (
    SELECT 'gateway' AS stage, 1 AS stage_order, o.request_id, o.seq, a.arrival_ns AS in_ns,
           o.ts_ns AS end_ns, o.service_ns
    FROM ev o JOIN arrivals a USING (request_id) WHERE o.type = 'accepted'
    UNION ALL
    SELECT h.stage, h.stage_order, o.request_id, o.seq, i.ts_ns, o.ts_ns, o.service_ns
    FROM hop h
    JOIN ev o ON o.type = h.out_type
    JOIN ev i ON i.type = h.in_type AND i.request_id = o.request_id
    UNION ALL
    SELECT 'engine', 5, f.request_id, NULL, i.ts_ns, f.ts_ns, f.engine_ns
    FROM fin f JOIN ev i ON i.type = 'tokenized' AND i.request_id = f.request_id
    UNION ALL
    SELECT 'detokenize', 6, o.request_id, o.seq, coalesce(i.ts_ns, f.ts_ns), o.ts_ns, o.service_ns
    FROM ev o
    LEFT JOIN ev i ON i.type = 'tokens' AND i.request_id = o.request_id AND i.seq = o.seq
    LEFT JOIN fin f ON f.request_id = o.request_id
    WHERE o.type = 'text' AND (i.ts_ns IS NOT NULL OR f.ts_ns IS NOT NULL)
    UNION ALL
    SELECT 'ledger', 7, o.request_id, NULL, t.ts_ns, o.ts_ns, o.service_ns
    FROM ev o JOIN term t USING (request_id) WHERE o.type = 'billed'
)
SELECT h.stage, h.stage_order, h.request_id, r.tenant, h.seq, h.in_ns,
       h.end_ns - h.service_ns AS start_ns, h.end_ns,
       h.end_ns - h.service_ns - h.in_ns AS queue_ns, h.service_ns
FROM hops h JOIN arrivals r USING (request_id);

-- Per request and stage: queue wait and service time (streamed stages summed over their hops).
CREATE OR REPLACE VIEW request_stages AS
SELECT request_id, tenant, stage, stage_order, count(*) AS num_hops,
       min(in_ns) AS in_ns, max(end_ns) AS end_ns,
       sum(queue_ns) / 1e6 AS queue_ms, sum(service_ns) / 1e6 AS service_ms
FROM stage_hops GROUP BY ALL;

-- Per stage, over hops: P50 / P95 / P99 of queue wait and service time.
CREATE OR REPLACE VIEW stage_latency AS
SELECT stage, stage_order, count(*) AS num_hops,
       quantile_cont(queue_ns / 1e6, 0.50) AS queue_p50_ms,
       quantile_cont(queue_ns / 1e6, 0.95) AS queue_p95_ms,
       quantile_cont(queue_ns / 1e6, 0.99) AS queue_p99_ms,
       quantile_cont(service_ns / 1e6, 0.50) AS service_p50_ms,
       quantile_cont(service_ns / 1e6, 0.95) AS service_p95_ms,
       quantile_cont(service_ns / 1e6, 0.99) AS service_p99_ms
FROM stage_hops GROUP BY stage, stage_order ORDER BY stage_order;

-- The engine's own gauges, when its events carry them (num_waiting, num_running, kv_usage).
CREATE OR REPLACE VIEW engine_gauges AS
SELECT ts_ns, request_id, type,
       TRY_CAST(data ->> '$.num_waiting' AS BIGINT) AS num_waiting,
       TRY_CAST(data ->> '$.num_running' AS BIGINT) AS num_running,
       TRY_CAST(data ->> '$.kv_usage' AS DOUBLE) AS kv_usage
FROM ev
WHERE type IN ('tokens', 'finished')
  AND (data ->> '$.num_waiting' IS NOT NULL OR data ->> '$.kv_usage' IS NOT NULL);

-- Queue depth from the log alone: requests that have arrived but have no first token (and no
-- end) yet, after each arrival or first token.
CREATE OR REPLACE VIEW queue_depth AS
WITH steps AS (
    SELECT arrival_ns AS ts_ns, 1 AS delta FROM requests
    UNION ALL
    SELECT coalesce(first_token_ns, end_ns), -1 FROM requests
    WHERE coalesce(first_token_ns, end_ns) IS NOT NULL
)
SELECT ts_ns, sum(delta) OVER (ORDER BY ts_ns, delta ROWS UNBOUNDED PRECEDING) AS depth
FROM steps;

-- Retrieval per request (the `assembled` event's trace): collections searched, candidates,
-- chunks kept and their prompt tokens, search and rerank time, and why the rerank fell back.
CREATE OR REPLACE VIEW retrievals AS
SELECT request_id, tenant, ts_ns,
       from_json(data -> '$.retrieval.collections', '["VARCHAR"]') AS collections,
       coalesce(TRY_CAST(data ->> '$.retrieval.num_candidates' AS INTEGER), 0) AS num_candidates,
       coalesce(TRY_CAST(data ->> '$.retrieval.num_kept' AS INTEGER), 0) AS num_kept,
       coalesce(TRY_CAST(data ->> '$.retrieval.num_tokens' AS INTEGER), 0) AS num_tokens,
       coalesce(TRY_CAST(data ->> '$.retrieval.search_ns' AS BIGINT), 0) / 1e6 AS search_ms,
       coalesce(TRY_CAST(data ->> '$.retrieval.rerank_ns' AS BIGINT), 0) / 1e6 AS rerank_ms,
       data ->> '$.retrieval.rerank_fallback' AS rerank_fallback,
       service_ns / 1e6 AS context_ms
FROM ev
WHERE type = 'assembled' AND (data -> '$.retrieval') IS NOT NULL;

-- Every retrieval candidate of every request: its scores and whether it was kept (or why not).
CREATE OR REPLACE VIEW retrieved_chunks AS
SELECT request_id, tenant, c.chunk_id, c.collection, c.source, c.num_tokens,
       c.vector_score, c.keyword_score, c.fused_score, c.rerank_score,
       coalesce(c.kept, false) AS kept, coalesce(c.reason, 'kept') AS reason
FROM (
    SELECT request_id, tenant, unnest(from_json(data -> '$.retrieval.chunks',
        '[{"chunk_id": "VARCHAR", "collection": "VARCHAR", "source": "VARCHAR",
           "num_tokens": "INTEGER", "vector_score": "DOUBLE", "keyword_score": "DOUBLE",
           "fused_score": "DOUBLE", "rerank_score": "DOUBLE", "kept": "BOOLEAN",
           "reason": "VARCHAR"}]')) AS c
    FROM ev WHERE type = 'assembled' AND (data -> '$.retrieval') IS NOT NULL
);
