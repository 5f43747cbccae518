"""Engine stage: the synchronous engine core behind the bus, a long-running handler of the
shared runtime (stages/runtime/service.py).

Takes `tokenized` only while KV capacity allows (admission: `capacity()`), runs step() in a
worker thread, publishes each step's tokens pipelined (the step's events leave in one socket
write: BRIGADE_STREAM_FLUSH), and settles a request's input only after
its `finished` event is stored — so a killed worker's request is redelivered and continued from
the tokens its worker stored: prompt plus those tokens, `max_tokens` reduced, each draw keyed by
(seed, position), so it samples what the uninterrupted run would have (engine.add_request's
num_prior_output).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import msgspec

from engine.errors import RequestRejected
from schemas import models
from schemas.events import (
    CancelRequested,
    Event,
    PromptTokenized,
    RunFinished,
    RunStarted,
    TokenLogprob,
    TokensGenerated,
    Usage,
    decoder_for,
)
from stages.detokenize import context_window
from stages.engine_params import (
    AdmissionConfig,
    admission_room,
    engine_config_from_env,
    rejected,
    sampling_params,
)
from stages.engine_rate import ComputeRate
from stages.engine_stream import StreamConfig, StreamInterval
from stages.runtime.cpu_priority import CpuPriority, LowPriorityThreads
from stages.runtime.failures import StageError
from stages.runtime.service import Held, InputService
from stages.runtime.spec import StageContext, StageSpec

STAGE = "engine"
# vLLM's iteration_tokens_total buckets: the tokens one engine step computes
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SWITCH_INTERVAL_S = 0.0005  # Python's default is 0.005: up to 5 ms before the loop gets the GIL
log = logging.getLogger("brigade.engine")


@dataclass(eq=False, kw_only=True)
class Run:
    """One admitted request: its held input, its published deltas and its timings."""

    held: Held
    event: PromptTokenized
    window: int  # context tokens each `tokens` event carries
    params: Any = None  # engine.SamplingParams
    added_ns: int | None = None
    first_token_ns: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_tokens_through: list[int] = field(default_factory=list)  # per seq: output count after it
    pending: list[tuple[Event, Any]] = field(default_factory=list)  # (event, ack future)
    unsent: TokensGenerated | None = None  # steps held back while detokenize lags (coalesced)
    cancel: CancelRequested | None = None
    num_cached_tokens: int = 0  # prompt tokens the engine did not compute (prefix cache, fork)
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.event.request_id

    @property
    def fetched_ns(self) -> int:  # monotonic
        return self.held.received_ns

    @property
    def num_prompt(self) -> int:
        return len(self.event.prompt_token_ids)

    @property
    def num_left(self) -> int:
        """Output tokens still allowed (the engine's max_tokens counts from its own prompt)."""
        return self.event.sampling.max_tokens - len(self.output_ids)

    @property
    def next_seq(self) -> int:
        return len(self.num_tokens_through)

    @property
    def stop_seq(self) -> int | None:
        c = self.cancel
        return c.seq if c is not None and c.reason == "stop_string" else None


class EngineStage(InputService):
    """The engine worker: admission by KV room, a step loop in a thread, cancels that abort."""

    def __init__(
        self,
        engine: Any,
        ctx: StageContext,
        admission: AdmissionConfig,
        priority: CpuPriority | None = None,
        model: models.ServedModel | None = None,
    ) -> None:
        self.engine = engine
        # the one model artifact this worker serves: its id goes on every event it publishes
        # and, with the artifact's identity, into its heartbeat (the edge's /v1/models, /health)
        self.model = model
        self.model_id = model.id if model is not None else None
        self._announcement = announcement(engine, model)
        # step() runs below the stages' event loops and nats-server (stages/runtime/cpu_priority.py)
        self._lowered = LowPriorityThreads(priority or CpuPriority.from_env())
        self.ctx = ctx
        self.bus = ctx.bus
        self.admission = admission
        self.runs: dict[str, Run] = {}
        self._to_add: list[Run] = []
        self._to_abort: set[str] = set()
        self._step_reported = False  # this step's first tokens event is out (it carries the size)
        self._work = anyio.Event()  # new work for the step loop
        self._num_admitted = 0  # requests admitted so far, and their prompt tokens: the mean
        self._num_admitted_tokens = 0  # request's size, by which capacity() pulls
        self.step_tokens = StepTokens()  # every step's size, for the edge's iteration_tokens
        self.compute_rate = ComputeRate()  # every step's size and time: what a token costs
        # tokens per event: one while detokenize keeps up, more while it lags (engine_stream.py)
        self.stream = StreamInterval(self.bus, StreamConfig.from_env())

    # ---- admission ----

    def capacity(self) -> int:
        """How many `tokenized` inputs to take now (0: wait for KV room or a free slot): as
        many as fit in the free blocks at the mean size of the requests admitted so far, so a
        worker holds no request its KV cannot start while another worker may have room."""
        stats = self.engine.stats()
        bm = self.engine.block_manager
        reserved = sum(
            bm.num_blocks_for(len(r.event.prompt_token_ids) + 1)
            for r in self.runs.values()
            if r.first_token_ns is None
        )
        mean = self._num_admitted_tokens // max(1, self._num_admitted)
        # before the first request its size is unknown: one at a time (the whole cache's worth)
        per_request = bm.num_blocks_for(mean + 1) if self._num_admitted else stats.num_total_blocks
        return admission_room(
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            reserved_blocks=reserved,
            num_active=len(self.runs),
            config=self.admission,
            blocks_per_request=per_request,
        )

    def health(self) -> dict[str, Any]:
        """The heartbeat's readiness detail: the model is loaded (this service exists only
        after it was) and how much KV room is free."""
        stats = self.engine.stats()
        return {
            "model_loaded": True,
            **self._announcement,
            "num_free_blocks": stats.num_free_blocks,
            "num_total_blocks": stats.num_total_blocks,
            "kv_usage": round(stats.kv_usage, 4),
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "iteration_tokens": self.step_tokens.as_detail(),
            "compute_tok_s": self._compute_tok_s(),
            # the fused decode forward's threads, since the model loaded: waits for a phase's
            # last items, and items computed twice (a thread preempted mid-item)
            "decode_wait_s": round(stats.decode_wait_s, 6),
            "num_decode_redone": stats.num_decode_redone,
        }

    async def admit(self, held: Held, event: PromptTokenized) -> None:
        """Take one request (a StageError fails it: the runtime publishes `failed`, acks)."""
        rid = event.request_id
        if rid in self.runs:  # a redelivery of a request this worker is still running
            await held.in_progress()
            held.forget()  # the run's own delivery stays the one settled at its end
            return
        run = Run(held=held, event=event, window=context_window(event.sampling.stop))
        if rid in self.ctx.cancels:  # cancelled before it reached the engine: it never ran,
            reason = self.ctx.cancels.reason(rid) or "client"  # so there is nothing to bill
            run.cancel = CancelRequested(request_id=rid, tenant=event.tenant, reason=reason)
            await self._finish(run, "abort", num_prompt_tokens=0, seed=None)
            return
        run.params = sampling_params(event.sampling, rid)
        self._num_admitted += 1
        self._num_admitted_tokens += len(event.prompt_token_ids)
        if held.num_delivered > 1 and not await self._recover(run):
            return
        self.runs[rid] = run
        self._to_add.append(run)
        self._work.set()

    async def _recover(self, run: Run) -> bool:
        """A redelivery: the worker that had this request died. Take the steps it stored as
        this run's output and continue after them; False when nothing is left to run (its
        `finished` was stored, a cancel came meanwhile, or the stored steps were its end)."""
        stored = await self.bus.replay(run.request_id)
        if any(isinstance(e, RunFinished) for e in stored):
            await run.held.ack()  # finished was stored; only the ack was lost
            return False
        by_seq = {e.seq: e.token_ids for e in stored if isinstance(e, TokensGenerated)}
        while run.next_seq in by_seq:  # the contiguous steps; a gap's later ones come again
            run.output_ids.extend(by_seq[run.next_seq])
            run.num_tokens_through.append(len(run.output_ids))
        cancels = [e for e in stored if isinstance(e, CancelRequested)]
        if cancels:  # cancelled (or stopped by a stop string) while its worker was dying
            run.cancel = cancels[0]
            await self._finish(run, "abort", run.num_prompt, run.params.seed)
            return False
        p = run.params
        ends = set(p.stop_token_ids) | (
            set() if p.ignore_eos else {self.engine.tokenizer.eos_token_id}
        )
        last = run.output_ids[-1] if run.output_ids else None
        if last in ends or run.num_left <= 0:  # its last step was stored, its end was not
            reason = "stop" if last in ends else "length"
            await self._finish(run, reason, run.num_prompt, p.seed)
            return False
        if run.output_ids:
            run.params = dataclasses.replace(
                p, max_tokens=run.num_left, min_tokens=max(0, p.min_tokens - len(run.output_ids))
            )
        log.info("continuing %s after its %d stored steps", run.request_id, run.next_seq)
        return True

    def _add_pending(self) -> list[tuple[Run, StageError]]:
        """Hand fetched requests to the engine (between steps only: the core is not thread-safe)."""
        refused = []
        for run in self._to_add:
            priority = 1 if run.event.priority == "batch" else 0
            try:
                self.engine.add_request(
                    run.request_id,
                    run.event.prompt_token_ids + run.output_ids,
                    run.params,
                    priority,
                    # no prefix is shared across tenants, nor across models (each worker holds
                    # one model's blocks; the id in the domain keeps that true if one held more)
                    cache_domain=f"{self.model_id or ''}/{run.event.tenant or ''}",
                    # a run continuing after stored output: its grammar takes that output first,
                    # and its draws and penalties go on from it
                    constrained_output_ids=run.output_ids if run.params.constraint else (),
                    num_prior_output=len(run.output_ids),
                    # parallel sampling: share the prompt's K/V of the run named (if in flight)
                    fork_of=run.event.sampling.fork_of,
                )
                run.added_ns = time.monotonic_ns()
            except RequestRejected as err:
                refused.append((run, rejected(err)))
        self._to_add = []
        return refused

    # ---- cancellation ----

    def on_cancel(self, cancel: CancelRequested) -> None:
        """From the runtime's one cancel subscription: abort the run between steps."""
        run = self.runs.get(cancel.request_id)
        if run is None or run.cancel is not None:
            return  # unknown, finished, or already cancelled: late cancels are harmless
        run.cancel = cancel
        self._to_abort.add(cancel.request_id)
        self._work.set()

    # ---- stepping ----

    async def run(
        self,
        stopping: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Step until `stopping` is set and nothing runs. Cancelled past the drain, it aborts
        what is left in the core (the runtime hands those inputs back: another engine worker
        re-runs them, dedupe drops what was already stored)."""
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                tg.start_soon(self.stream.run, lambda: len(self.runs))
                await self.step_loop(stopping, tg)
                tg.cancel_scope.cancel()  # the lag sampler; what steps started has finished
        finally:
            for rid in list(self.runs):
                self.engine.abort_request(rid)  # no step is running: cancellation waits for it
            self.runs.clear()
            self._to_add.clear()

    async def step_loop(self, stop: anyio.Event, tg: anyio.abc.TaskGroup) -> None:
        while True:
            for run, err in self._add_pending():
                del self.runs[run.request_id]
                tg.start_soon(run.held.fail, run.event, err)
            for rid in self._to_abort:
                self.engine.abort_request(rid)  # frees its KV blocks now; reported by step()
            self._to_abort.clear()
            if not self.engine.has_unfinished_requests():
                if stop.is_set() and not self._to_add:
                    return
                self._work = anyio.Event()
                with anyio.move_on_after(0.5):
                    await self._work.wait()
                continue
            began = time.monotonic_ns()
            try:
                outputs = await anyio.to_thread.run_sync(self._step)
            except Exception as err:  # noqa: BLE001 - a broken step fails what it was running
                log.exception("engine step failed")
                self._fail_all(tg, f"the engine step failed: {type(err).__name__}: {err}")
                continue
            took = time.monotonic_ns() - began
            stats = self.engine.stats()
            self.step_tokens.observe(stats.num_step_tokens)
            self.compute_rate.observe(stats.num_step_tokens, took)
            self._step_reported = False  # the step's size rides on its first tokens event
            for out in outputs:
                run = self.runs.get(out.request_id)
                if run is not None:
                    await self._on_output(run, out, took, stats, tg)
            if self.stream.config.flush == "step":
                await anyio.sleep(0)  # nats-py's flusher writes the step's events at once
            self.ctx.room_changed()

    def _step(self) -> list[Any]:
        """In the worker thread: lowered once (with the torch threads it starts), then one step."""
        self._lowered.ensure()
        return self.engine.step()

    def _fail_all(self, tg: anyio.abc.TaskGroup, message: str) -> None:
        for rid, run in list(self.runs.items()):
            self.engine.abort_request(rid)
            del self.runs[rid]
            tg.start_soon(run.held.fail, run.event, StageError("internal", message))

    async def _on_output(
        self, run: Run, out: Any, took_ns: int, stats: Any, tg: anyio.abc.TaskGroup
    ) -> None:
        rid = run.request_id
        run.num_cached_tokens, run.num_preemptions = out.num_cached_tokens, out.num_preemptions
        if out.new_token_ids and run.stop_seq is None:
            now = time.monotonic_ns()
            run.first_token_ns = run.first_token_ns or now
            logprobs = None
            if out.new_logprobs is not None:
                logprobs = [[TokenLogprob(t, lp) for t, lp in step] for step in out.new_logprobs]
            event = TokensGenerated(
                request_id=run.request_id,
                tenant=run.event.tenant,
                service_ns=took_ns,
                seq=run.next_seq,
                token_ids=list(out.new_token_ids),
                context_token_ids=run.output_ids[-run.window :] if run.window else [],
                stop=run.event.sampling.stop,
                logprobs=logprobs,
                prompt_logprobs=(
                    None
                    if out.prompt_logprobs is None
                    else [[TokenLogprob(t, lp) for t, lp in e] for e in out.prompt_logprobs]
                ),
                num_waiting=stats.num_waiting,
                num_running=stats.num_running,
                kv_usage=round(stats.kv_usage, 4),
                num_step_tokens=None if self._step_reported else stats.num_step_tokens,
                model=self.model_id,
                compute_tok_s=self._compute_tok_s(),
            )
            first_of_step = not self._step_reported  # it carries the step's size: sent now
            self._step_reported = True
            run.output_ids.extend(out.new_token_ids)
            run.unsent = event if run.unsent is None else _coalesced(run.unsent, event)
            if (
                first_of_step
                or run.next_seq == 0  # the first token: TTFT never waits
                or out.finished
                or len(run.unsent.token_ids) >= self.stream.interval
            ):
                await self._send(run)
        if out.finished and run.unsent is not None and run.stop_seq is None:
            await self._send(run)  # what an abort or a failure left held
        if out.finished:
            del self.runs[rid]
            tg.start_soon(self._finish, run, out.finish_reason, run.num_prompt, out.seed)

    async def _send(self, run: Run) -> None:
        """Publish the run's held steps as one `tokens` event (pipelined; `_finish` awaits the
        acks). Its seq is the next event's: seq counts events, whatever each carries."""
        event, run.unsent = run.unsent, None
        assert event is not None, "nothing held to send"
        if event.seq == 0:  # the run streams from here: once a run, ahead of its first tokens
            started = RunStarted(
                request_id=run.request_id,
                tenant=event.tenant,
                model=event.model,
                num_waiting=event.num_waiting,
                num_running=event.num_running,
                kv_usage=event.kv_usage,
                compute_tok_s=event.compute_tok_s,
            )
            run.pending.append((started, await self.bus.publish_async(started)))
        run.num_tokens_through.append(len(run.output_ids))
        run.pending.append((event, await self.bus.publish_async(event)))
        if self.stream.config.flush == "event":
            # Let nats-py's flusher write it now: ts_ns was stamped just before, and otherwise
            # every event of this step would wait for the last one to be prepared.
            await anyio.sleep(0)

    async def _finish(
        self, run: Run, reason: str, num_prompt_tokens: int, seed: int | None
    ) -> None:
        """Make sure every delta is stored, store `finished`, then ack the input."""
        try:
            for event, future in run.pending:  # a lost ack (a server restart): published again
                await self.bus.acked(event, future)
            finished = self._finished_event(run, reason, num_prompt_tokens, seed)
            await self.bus.acked(finished, await self.bus.publish_async(finished))  # an election
            await run.held.ack()
        except Exception:  # noqa: BLE001 - unacked, the input comes back and is re-run
            log.exception("could not store the end of %s; it will be redelivered", run.request_id)
            run.held.forget()

    def _finished_event(
        self, run: Run, reason: str, num_prompt_tokens: int, seed: int | None
    ) -> RunFinished:
        now = time.monotonic_ns()
        last_seq = run.next_seq - 1 if run.next_seq else None
        num_out = len(run.output_ids)
        cancel_reason = None
        stop_seq = run.stop_seq
        if stop_seq is not None and stop_seq < run.next_seq:  # a stop string ended the text
            reason, last_seq, num_out = "stop", stop_seq, run.num_tokens_through[stop_seq]
        elif reason == "abort":
            cancel_reason = run.cancel.reason if run.cancel is not None else "client"
        added = run.added_ns or now
        first = run.first_token_ns or now
        ids = run.output_ids[:num_out]
        stats = self.engine.stats()  # after an abort its blocks are already back in the pool
        return RunFinished(
            request_id=run.request_id,
            tenant=run.event.tenant,
            service_ns=now - added,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=Usage(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=num_out,
                cached_tokens=min(run.num_cached_tokens, num_prompt_tokens),
            ),
            num_preemptions=run.num_preemptions,
            last_seq=last_seq,
            context_token_ids=ids[-run.window :] if run.window else [],
            stop=run.event.sampling.stop,
            seed=seed,
            queue_ns=added - run.fetched_ns,
            prefill_ns=first - added,
            decode_ns=now - first,
            cancel_reason=cancel_reason,
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            kv_usage=round(stats.kv_usage, 4),
            model=self.model_id,
            compute_tok_s=self._compute_tok_s(),
        )

    def _compute_tok_s(self) -> float | None:
        rate = self.compute_rate.tok_s
        return None if rate is None else round(rate, 1)


def _coalesced(held: TokensGenerated, step: TokensGenerated) -> TokensGenerated:
    """`held` (steps not yet sent) followed by one more step: its seq and context stay the
    held ones', the tokens and logprobs run on, the time adds up, the gauges are the latest."""
    logprobs = None
    if held.logprobs is not None and step.logprobs is not None:
        logprobs = held.logprobs + step.logprobs
    return msgspec.structs.replace(
        held,
        token_ids=held.token_ids + step.token_ids,
        logprobs=logprobs,
        service_ns=held.service_ns + step.service_ns,
        num_waiting=step.num_waiting,
        num_running=step.num_running,
        kv_usage=step.kv_usage,
        num_step_tokens=step.num_step_tokens,
        compute_tok_s=step.compute_tok_s,
    )


@dataclass
class StepTokens:
    """A histogram of the tokens each step computed (prefill and decode), since this worker
    started: every run's steps, whoever submitted it (the edge or straight on NATS). It rides
    in the heartbeat; the edge serves it as `iteration_tokens_total`."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    total: int = 0

    def observe(self, num_tokens: int) -> None:
        at = next((i for i, le in enumerate(STEP_TOKEN_BUCKETS) if num_tokens <= le), -1)
        self.counts[at] += 1  # the last slot: above every bound (+Inf)
        self.total += num_tokens

    def as_detail(self) -> dict[str, Any]:
        """Prometheus' shape: cumulative counts at each upper bound, +Inf last, and the sum."""
        return {
            "le": list(STEP_TOKEN_BUCKETS),
            "cumulative": list(itertools.accumulate(self.counts)),
            "sum": self.total,
        }


def announcement(engine: Any, model: models.ServedModel | None) -> dict[str, Any]:
    """What a worker says it serves: the model's id and artifact, and what makes two workers
    of one id interchangeable (weights' format, dtype, quantization, window, tokenizer and
    template fingerprint)."""
    if model is None:
        return {}
    from engine.loader import resolve_quantization
    from engine.weights import model_format, resolve_model

    config = engine.config
    tok = engine.tokenizer
    fmt = model_format(resolve_model(config.model))
    quant = resolve_quantization(
        config.quantization, engine.dtype, engine.device, config.batch_invariant
    )
    # weight-only quantization of the linears; else a GGUF's own blocks where the engine reads them
    quant = quant or ("gguf-blocks" if fmt == "gguf" and config.quantized_gemv else "none")
    return {
        "model": model.id,
        "artifact": model.artifact,
        "format": fmt,
        "dtype": config.dtype,
        "quantization": quant,
        "max_model_len": engine.max_model_len,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.fingerprint(),
    }


def load_engine(model: models.ServedModel | None = None) -> Any:
    """The engine of the BRIGADE_* variables, of `model`'s artifact (default: BRIGADE_MODEL's
    first); in a thread: it takes seconds."""
    from engine import Engine

    engine_config = engine_config_from_env()
    if model is not None:
        engine_config = dataclasses.replace(engine_config, model=model.artifact)
    began = time.monotonic()
    log.info(
        "loading model %s (%s, %s)", engine_config.model, engine_config.dtype, engine_config.device
    )
    lowered = LowPriorityThreads(CpuPriority.from_env())
    lowered.ensure()  # torch threads started while loading keep the priority
    engine = Engine(engine_config)
    log.info("model loaded in %.1f s", time.monotonic() - began)
    return engine


def spec(
    *,
    engine: Any = None,
    admission: AdmissionConfig | None = None,
    model: models.ServedModel | None = None,
) -> StageSpec:
    """The engine stage, bound to one model: `model`, else BRIGADE_ENGINE_MODEL's (by default
    BRIGADE_MODEL's first). It consumes only the `tokenized` events routed to that model
    (llm.ev.*.tokenized.<its token>, through the model's own durable) and announces it. With
    `engine` (tests, benches) it serves that one instead of loading the model's artifact."""
    bound = model if model is not None else models.engine_model()

    async def setup(ctx: StageContext) -> Any:
        # step() runs in a thread and holds the GIL between torch ops; a short switch interval
        # lets the event loop (this stage's publishes, every stage sharing the process) in.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        if engine is not None:
            return engine
        return await anyio.to_thread.run_sync(load_engine, bound)

    def service(ctx: StageContext, loaded: Any) -> EngineStage:
        config = admission or AdmissionConfig(max_active=loaded.config.max_num_seqs)
        return EngineStage(loaded, ctx, config, model=bound)

    return StageSpec(
        name=STAGE,
        input_event="tokenized",
        route=bound.token,
        decoder=decoder_for(PromptTokenized),
        service=service,
        setup=setup,
        skip_cancelled=False,  # a cancelled request still gets its `finished` (abort) here
        retry_errors=True,  # an admission that failed on the bus (a replay) is tried again
        ack_wait_s=30.0,
        max_hold_s=24 * 3600.0,  # an input is held until its `finished` is stored
        drain_s=5.0,  # on stop: running requests finish or are handed back to another worker
    )


SPEC = spec()  # bound when imported; `brigade stage engine` binds at its start (serve)


async def serve(*, config: Any, stop: Any, ready: Any = None, handle_signals: bool = True) -> None:
    """`brigade stage engine`: one worker of the model BRIGADE_ENGINE_MODEL names (default:
    BRIGADE_MODEL's first)."""
    from stages.runtime import worker as runtime

    bound = spec(model=models.engine_model())
    await runtime.serve(bound, config=config, stop=stop, ready=ready, handle_signals=handle_signals)
