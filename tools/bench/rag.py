"""`brigade bench rag`: retrieval quality on the fixture corpus and retrieval latency by size.

Quality: the corpus (tools/bench/rag_data: Persuasion chapters 1-8 and a snapshot of this
project's README and API page) is chunked and embedded as the ingest service does, into a
DuckDB store; each question's supporting chunk is the one holding its evidence text
(whitespace-normalized). Reported side by side: recall@1/5/10 and MRR (over the top 20) for
vector only, keyword (BM25) only, hybrid (reciprocal rank fusion) and hybrid + rerank (the
served model's query likelihood over the hybrid top top_k x over_retrieve, run in-process on the
engine, batched, as the context stage runs it through the engine, and interpolated with the
fused score as the context stage does: stages/retrieval/rerank.py), with the same scores
ordered by the likelihood alone and by RRF with the hybrid order beside it; --yes-no adds the
model's log P(yes) - log P(no) as a second reranker. rag.json keeps every question's
candidates and scores.

Latency: the context stage's added work per request (embed the query, hybrid search, pack
into the budget) at 1k, 10k and 100k chunks (synthetic texts from the corpus's words, random
unit vectors), P50 / P95 over the questions' second pass, with its CPU time (the work, without
waits for a core) and the first pass's pack (every chunk's block counted anew); the rerank's
cost from the quality run. Writes rag.md and rag.json.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.files import write_results

DATA = Path(__file__).with_name("rag_data")
COLLECTION = "fixture"
TENANT = "bench"
MAX_RANK = 20


def register(subparsers) -> None:
    p = subparsers.add_parser("rag", help="retrieval recall / MRR by retriever; latency by size")
    p.add_argument("--out", default=".brigade/bench", help="directory for rag.md/.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--over-retrieve", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=192)
    p.add_argument("--chunk-overlap", type=int, default=32)
    p.add_argument("--sizes", default="1000,10000,100000", help="chunk counts for latency")
    p.add_argument("--no-rerank", action="store_true", help="skip the (slow) rerank column")
    p.add_argument("--yes-no", action="store_true", help="also rerank by the model's yes / no")
    p.add_argument("--questions", type=int, help="only the first N questions")
    p.add_argument(
        "--embedding-precision", default="bf16", choices=("bf16", "fp32"),
        help="the embedding model's products (engine/embedding.py; the services use bf16)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def questions() -> list[dict]:
    return [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines()]


def corpus_files() -> list[Path]:
    """The corpus: every Markdown file under rag_data but its own README."""
    return sorted(p for p in DATA.rglob("*.md") if p != DATA / "README.md")


def first_hit(ranked_texts: list[str], evidence: str) -> int | None:
    """1-based rank of the first chunk holding the evidence, None when none of them does."""
    e = norm(evidence)
    for rank, text in enumerate(ranked_texts, 1):
        if e in norm(text):
            return rank
    return None


def quality(ranks: list[int | None]) -> dict[str, float]:
    n = len(ranks)
    return {
        "recall@1": sum(1 for r in ranks if r is not None and r <= 1) / n,
        "recall@5": sum(1 for r in ranks if r is not None and r <= 5) / n,
        "recall@10": sum(1 for r in ranks if r is not None and r <= 10) / n,
        "mrr": sum(1 / r for r in ranks if r is not None) / n,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def build_fixture(store, embed, tok, chunking) -> int:
    from stages.retrieval.ingest import add_text

    store.create_collection(TENANT, COLLECTION)
    for path in corpus_files():
        add_text(
            store, embed, tok, chunking, tenant=TENANT, collection=COLLECTION,
            source=str(path.relative_to(DATA)), text=path.read_text(),
        )  # fmt: skip
    return store.get_collection(TENANT, COLLECTION).num_chunks


def run_engine(engine, prompts: list[list[int]], params) -> list:
    """Every prompt through the engine at once (batched as the engine stage batches them);
    -> each request's first output."""
    rids = [f"rr{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        engine.add_request(rid, ids, params)
    first: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, out)
    return [first[rid] for rid in rids]


def query_likelihood_scores(engine, tok, query: str, passages: list[str]) -> list[float]:
    """The context stage's reranker (stages/retrieval/rerank.py), in-process."""
    from engine import SamplingParams
    from stages.retrieval.rerank import query_likelihood, query_likelihood_prompt

    prompts = [query_likelihood_prompt(tok, query, p) for p in passages]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = run_engine(engine, [ids for ids, _ in prompts], params)
    return [query_likelihood(o.prompt_logprobs, start) for o, (_, start) in zip(outs, prompts, strict=True)]  # fmt: skip


YES_NO = "Answer with yes or no only: does the passage answer the question?"


def yes_no_scores(engine, tok, query: str, passages: list[str]) -> list[float]:
    """The alternative measured against it: log P(yes) - log P(no) of one greedy token."""
    from engine import SamplingParams

    yes = {tok.encode_text(w)[0] for w in ("yes", "Yes", " yes", " Yes")}
    no = {tok.encode_text(w)[0] for w in ("no", "No", " no", " No")}
    prompts = [
        tok.encode_chat(
            [
                {"role": "system", "content": YES_NO},
                {
                    "role": "user",
                    "content": f"Passage:\n{p}\n\nQuestion: {query}\nAnswer yes or no.",
                },
            ],
            add_generation_prompt=True,
        )
        for p in passages
    ]
    outs = run_engine(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
    scores = []
    for o in outs:
        top = dict(o.new_logprobs[0])
        floor = min(top.values())  # a side missing from the top 20: at most the smallest seen
        p_yes = max([top[i] for i in yes if i in top], default=floor)
        p_no = max([top[i] for i in no if i in top], default=floor)
        scores.append(p_yes - p_no)
    return scores


def run_quality(args, index, embed, tok, qs) -> tuple[dict, dict]:
    vectors = embed([q["question"] for q in qs])
    num_candidates = args.top_k * args.over_retrieve
    ranks: dict[str, list[int | None]] = {"vector": [], "keyword": [], "hybrid": []}
    pools = []
    for q, v in zip(qs, vectors, strict=True):
        by_vector = [index.chunks[i].text for i, _ in index.vector_ranked(v, MAX_RANK)]
        by_keyword = [index.chunks[i].text for i, _ in index.keyword_ranked(q["question"], MAX_RANK)]  # fmt: skip
        hybrid = index.hybrid(q["question"], v, max(MAX_RANK, num_candidates))
        ranks["vector"].append(first_hit(by_vector, q["evidence"]))
        ranks["keyword"].append(first_hit(by_keyword, q["evidence"]))
        ranks["hybrid"].append(first_hit([c.chunk.text for c in hybrid], q["evidence"]))
        pools.append(hybrid[:num_candidates])
    from stages.retrieval.rerank import reranked_order
    from stages.retrieval.search import reciprocal_rank_fusion

    cost: dict = {}
    rerank_scores: list[dict] = []  # per question: the candidates, their fused and rerank scores
    scorers = [] if args.no_rerank else [("hybrid + rerank", query_likelihood_scores)]
    if args.yes_no:
        scorers.append(("hybrid + yes/no rerank", yes_no_scores))
    if scorers:
        from engine import Engine, EngineConfig

        engine = Engine(EngineConfig(model=args.model))
    for name, scorer in scorers:
        ranks[name] = []
        times = []
        for q, pool in zip(qs, pools, strict=True):
            texts = [c.chunk.text for c in pool]
            start = time.perf_counter()
            scores = scorer(engine, engine.tokenizer, q["question"], texts)
            times.append(time.perf_counter() - start)
            alone = sorted(range(len(pool)), key=lambda i: (-scores[i], i))  # ties: fused order
            if name != "hybrid + rerank":
                ranks[name].append(first_hit([texts[i] for i in alone], q["evidence"]))
                continue
            # the context stage's order (rerank.py), then the same scores ordered otherwise
            fused = [c.fused_score for c in pool]
            by_rank = [i for i, _ in reciprocal_rank_fusion([list(range(len(pool))), alone])]
            for row, order in (
                (name, reranked_order(fused, scores)),
                ("hybrid + rerank: likelihood alone", alone),
                ("hybrid + rerank: RRF with the hybrid order", by_rank),
            ):
                ranks.setdefault(row, []).append(
                    first_hit([texts[i] for i in order], q["evidence"])
                )
            rerank_scores.append({"chunk_ids": [c.chunk.chunk_id for c in pool], "fused": fused,
                                  "likelihood": scores})  # fmt: skip
            print(f"\r{name}: {len(times)}/{len(qs)} questions", end="", file=sys.stderr)
        print(file=sys.stderr)
        cost[name] = {
            "candidates": num_candidates,
            "p50_s": statistics.median(times),
            "p95_s": percentile(times, 0.95),
            "passage_tokens_mean": statistics.mean(
                sum(c.chunk.num_tokens for c in pool) for pool in pools
            ),
        }
    result = {name: quality(r) | {"ranks": r} for name, r in ranks.items()}
    if rerank_scores:
        cost["hybrid + rerank"]["scores"] = rerank_scores
    return result, cost


def synthetic_index(n: int, words: list[str], rng: random.Random, real_chunks, real_vectors):
    import numpy as np

    from stages.retrieval.search import Index
    from stages.retrieval.store import StoredChunk

    texts = [" ".join(rng.choices(words, k=120)) for _ in range(n - len(real_chunks))]
    chunks = list(real_chunks) + [
        StoredChunk(
            chunk_id=f"syn:{i}",
            collection=COLLECTION,
            doc_id="syn",
            source="synthetic",
            start=0,
            end=len(t),
            num_tokens=160,
            text=t,
        )  # fmt: skip
        for i, t in enumerate(texts)
    ]
    noise = np.random.default_rng(rng.randrange(2**32)).standard_normal((len(texts), 384))
    noise = (noise / np.linalg.norm(noise, axis=1, keepdims=True)).astype(np.float32)
    return Index.build(chunks, np.concatenate([real_vectors, noise]))


def run_latency(args, real_chunks, real_vectors, embed, tok, qs) -> dict:
    from schemas.events import Message, Request, Sampling
    from stages.fit import Costs, fit
    from stages.retrieval.pack import BlockCounts, pack

    rng = random.Random(args.seed)
    words = sorted({w for c in real_chunks for w in re.findall(r"[A-Za-z]{3,}", c.text)})
    costs = Costs(tok)
    out = {}
    for n in [int(s) for s in args.sizes.split(",")]:
        build_start = time.perf_counter()
        index = synthetic_index(n, words, rng, real_chunks, real_vectors)
        build_s = time.perf_counter() - build_start
        timings: dict[str, list[float]] = {"embed": [], "search": [], "pack": [], "total": []}
        counts = BlockCounts(costs)  # as the context stage keeps them
        first_pack: list[float] = []  # pack in the first pass: each chunk's block counted anew
        cpu: list[float] = []  # the whole step's CPU time on this thread (every part runs on it)
        for rep in range(2):  # the first pass warms caches; the second is reported
            for q in qs:
                request = Request(
                    messages=[Message(role="user", content=q["question"])],
                    sampling=Sampling(max_tokens=256),
                )
                c0, t0 = time.thread_time(), time.perf_counter()
                vector = embed([q["question"]])[0]
                t1 = time.perf_counter()
                found = index.hybrid(q["question"], vector, args.top_k * args.over_retrieve)
                t2 = time.perf_counter()
                pack(fit(request, costs, 7936), found, costs, 7936, args.top_k, counts)
                t3 = time.perf_counter()
                if not rep:
                    first_pack.append((t3 - t2) * 1e3)
                if rep:
                    for name, dt in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                        timings[name].append(dt * 1e3)
                    cpu.append((time.thread_time() - c0) * 1e3)  # the work, without the waits
        out[str(n)] = {
            "index_build_s": build_s,
            "pack_first_p50_ms": percentile(first_pack, 0.5),
            "pack_first_p95_ms": percentile(first_pack, 0.95),
            "total_cpu_p50_ms": percentile(cpu, 0.5),
            "total_cpu_p95_ms": percentile(cpu, 0.95),
        } | {
            f"{name}_{p}_ms": percentile(v, q)
            for name, v in timings.items()
            for p, q in (("p50", 0.5), ("p95", 0.95))
        }
    return out


def table(res: dict) -> str:
    lines = [
        "| retriever | recall@1 | recall@5 | recall@10 | MRR |",
        "|---|---|---|---|---|",
    ]
    for name, q in res["quality"].items():
        lines.append(
            f"| {name} | {q['recall@1']:.3f} | {q['recall@5']:.3f} | {q['recall@10']:.3f} | "
            f"{q['mrr']:.3f} |"
        )
    lines += [
        "",
        f"{res['num_questions']} questions over {res['num_chunks']} chunks "
        f"({res['chunk_tokens']} tokens, overlap {res['chunk_overlap']}); rerank over the "
        f"hybrid top {res['top_k']} x {res['over_retrieve']}.",
        "",
        f"Latency: the {res['num_questions']} questions' second pass (the first warms caches; "
        f"its pack, every chunk's block counted anew, is the last column); embedding in "
        f"{res['embedding_precision']}.",
        "",
        "| chunks | embed P50 / P95 ms | search P50 / P95 ms | pack P50 / P95 ms | "
        "total P50 / P95 ms | total CPU P50 / P95 ms | index build s | "
        "first-pass pack P50 / P95 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, t in res["latency"].items():
        lines.append(
            f"| {int(n):,} | {t['embed_p50_ms']:.2f} / {t['embed_p95_ms']:.2f} | "
            f"{t['search_p50_ms']:.2f} / {t['search_p95_ms']:.2f} | "
            f"{t['pack_p50_ms']:.2f} / {t['pack_p95_ms']:.2f} | "
            f"{t['total_p50_ms']:.2f} / {t['total_p95_ms']:.2f} | "
            f"{t['total_cpu_p50_ms']:.2f} / {t['total_cpu_p95_ms']:.2f} | {t['index_build_s']:.1f} | "
            f"{t['pack_first_p50_ms']:.2f} / {t['pack_first_p95_ms']:.2f} |"
        )
    for name, r in res["rerank"].items():
        lines += [
            "",
            f"{name}: {r['candidates']} candidates ({r['passage_tokens_mean']:.0f} passage "
            f"tokens) per question, P50 {r['p50_s']:.2f} s / P95 {r['p95_s']:.2f} s in-process.",
        ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.embedding import Embedder
    from engine.tokenizer import load_tokenizer
    from stages.retrieval.ingest import Chunking
    from stages.retrieval.search import Indexes
    from stages.retrieval.store import Store

    tok = load_tokenizer(args.model)
    embedder = Embedder(precision=args.embedding_precision)
    qs = questions()[: args.questions]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "retrieval.duckdb")
        chunking = Chunking(max_tokens=args.chunk_tokens, overlap=args.chunk_overlap)
        num_chunks = build_fixture(store, embedder.embed, tok, chunking)
        index = Indexes(store).get(TENANT, [COLLECTION])
    unsupported = [q["question"] for q in qs if first_hit([c.text for c in index.chunks], q["evidence"]) is None]  # fmt: skip
    if unsupported:
        print(f"bench rag: no chunk holds the evidence of {unsupported}; they count as misses")
    quality_res, rerank = run_quality(args, index, embedder.embed, tok, qs)
    latency = run_latency(args, index.chunks, index.vectors, embedder.embed, tok, qs)
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
        "embedding_precision": args.embedding_precision,
        "num_questions": len(qs),
        "num_chunks": num_chunks,
        "unsupported": unsupported,
        "chunk_tokens": args.chunk_tokens,
        "chunk_overlap": args.chunk_overlap,
        "top_k": args.top_k,
        "over_retrieve": args.over_retrieve,
        "quality": quality_res,
        "rerank": rerank,
        "latency": latency,
    }
    write_results(args.out, "rag", res, table(res))
    return 0
