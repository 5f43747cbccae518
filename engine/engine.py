"""Engine: the synchronous core. add_request, step() -> outputs, abort_request; no I/O.

One step is: schedule -> run the model on the scheduled tokens -> sample -> update state.
Given each request's seed the outputs are deterministic, whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.errors import RequestRejected
from engine.grammar import GrammarCache
from engine.kv_cache import DEFAULT_KV_CACHE_BYTES, KVCache, num_blocks_for_budget
from engine.loader import load_model
from engine.model_runner import ModelRunner, PromptRows
from engine.params import SamplingParams
from engine.sampler import SamplingRequest, draw_seed, takes_the_argmax
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.spec_decode import propose_drafts, sample_and_verify, verify_greedy
from engine.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", *DTYPES)  # "auto": the model's dtype


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = "smollm2-135m"
    # float32: the only dtype that keeps the quality targets (brigade bench quality); bfloat16
    # (with int4 GEMVs by default) is 3-6x faster on the CPU and misses top-1 by ~3 points
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None -> DEFAULT_KV_CACHE_BYTES
    # the K/V cache's element type: "auto", the model's; "float16" under the float32 model on the
    # CPU: each K and V rounded to fp16 once, as it is stored, and read back into fp32 sums (half
    # the cache's bytes a step reads and twice the tokens a budget holds; its KL in the quality
    # table, docs/benchmarks.md)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # overrides the memory budget (tests, benchmarks)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None -> the model's context length
    # weights: "auto" (int4 weight-only for bf16 on the CPU, else dense), None, "int8", "int4"
    quantization: str | None = "auto"
    # bit-identical logits for a token whatever shares its step (fp32 on a GGUF's blocks or bf16,
    # on the CPU; see loader.check_batch_invariant)
    batch_invariant: bool = False
    # fp32 GGUF on the CPU: steps of <= 32 rows read the file's Q4_1 / Q8_0 blocks (the same fp32
    # weights, a sixth of the bytes; engine/gguf_linear.py); False: dense fp32 at every step
    quantized_gemv: bool = True
    # those steps of <= 32 tokens run every layer in one C call (kernels/cpu_decode.py): the same
    # GEMV sums, fp32 norms, RoPE and attention without the torch path's small ops
    fused_decode: bool = True
    # greedy rows of a Q8_0 LM head (fp32 on the CPU, AVX-512 VNNI): an int8 screen, then the
    # fp32 logits of the tokens it leaves; the same tokens (kernels/cpu_greedy_head.py)
    screened_head: bool = True
    # steps of more than 32 rows (prefill chunks) on fp32 Q4_1 blocks run their GEMMs on AMX's
    # bf16 tiles, each factor split exactly into bf16 pieces and summed in fp32: the fp32
    # matmul up to summation order (kernels/cpu_amx_gemm.py), where AMX works on this CPU
    amx_prefill: bool = True
    # reuse the K/V of full blocks a prompt shares with earlier ones (see block_manager.py)
    enable_prefix_caching: bool = False
    # speculative decoding with the n-gram proposer (spec_decode.py): draft tokens per step for
    # greedy and sampled requests; 0 turns it off. Drafts are given while a step holds at most
    # speculative_max_rows decode rows (on the CPU: 8, the int4 GEMV regime, where a few more
    # rows cost almost nothing)
    num_speculative_tokens: int = 0
    speculative_max_rows: int = 8

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype={self.dtype!r}; allowed: {sorted(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}; allowed: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_dtype != self.dtype and not (
            (self.dtype, self.kv_dtype) == ("float32", "float16")
            and self.device == "cpu"
            and not self.batch_invariant
        ):
            raise ValueError(
                f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r} with dtype={self.dtype!r} "
                f"on {self.device!r}{' batch-invariant' if self.batch_invariant else ''}: a cache "
                "of another dtype than the model's is float16 under float32, on the CPU, without "
                "batch_invariant; allowed here: 'auto' or the model's dtype"
            )
        for name in ("num_speculative_tokens",):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)}; allowed: >= 0")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "speculative_max_rows",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)}; allowed: >= 1")
        for name in ("kv_cache_memory_bytes", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EngineConfig.{name}={value}; allowed: None or >= 1")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type, "auto" resolved to the model's dtype."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of blocks in use, 0..1
    num_preemptions: int
    num_prefix_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache
    num_prefix_hits: int = 0  # of those, tokens whose cached K/V were reused
    num_forked_tokens: int = 0  # prompt tokens shared by parallel samples (not computed again)
    num_step_tokens: int = 0  # tokens the last step computed (prefill chunks and decodes)
    num_draft_tokens: int = 0  # speculative tokens verified
    num_accepted_draft_tokens: int = 0  # of those, tokens the model agreed with
    grammar_s: float = 0.0  # time spent computing grammar masks and advancing their matchers
    # the fused decode forward's threads, since the model loaded (kernels/cpu_decode.Counters):
    decode_wait_s: float = 0.0  # waiting for a phase's last items (spinning, or redoing them)
    num_decode_redone: int = 0  # items computed twice (the second copy dropped)


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    num_prompt_tokens: int
    num_output_tokens: int
    seed: int
    new_logprobs: list[list[tuple[int, float]]] | None  # per new token: sampled, then top-n
    # with params.prompt_logprobs, on the request's first output: prompt token i + 1's entry
    prompt_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed: from the prefix cache or a fork
    num_preemptions: int = 0  # times this request was preempted (its K/V computed again)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = DTYPES[config.kv_dtype]
        self.model, self.model_config = load_model(
            config.model,
            dtype=self.dtype,
            device=self.device,
            quantization=config.quantization,
            batch_invariant=config.batch_invariant,
            quantized_gemv=config.quantized_gemv,
            fused_decode=config.fused_decode,
            screened_head=config.screened_head,
            amx_prefill=config.amx_prefill,
        )
        self.tokenizer = load_tokenizer(config.model)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.model_config,
            block_size=config.block_size,
            dtype=self.kv_dtype,
            budget_bytes=config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES,
        )
        self.kv_cache = KVCache(
            self.model_config,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.device)
        self._seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._aborted: list[StepOutput] = []  # reported by the next step()
        self._arrivals = itertools.count()
        self._grammars: GrammarCache | None = None  # built with the first constrained request
        self._grammar_ns = 0
        self._num_step_tokens = 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_domain: str = "",
        constrained_output_ids: list[int] | tuple[int, ...] = (),
        fork_of: str | None = None,
        num_prior_output: int = 0,
    ) -> int:
        """Queue a request; returns the seed it samples with. RequestRejected (a ValueError) if
        it can never run.

        cache_domain: with prefix caching, the request reuses only K/V computed for requests of
        the same domain (give each tenant its own, as vLLM's `cache_salt`).
        constrained_output_ids: with params.constraint, a run that resumes an earlier one gives
        the earlier output (also the end of its prompt): the grammar takes it first; when it is
        already a complete match, the next step reports the request finished ("stop").
        fork_of: parallel sampling (n > 1): an in-flight request of the same prompt and cache
        domain whose prompt K/V this one shares once computed (BlockManager.fork) instead of
        computing them again; any other id, or a different prompt, runs it on its own.
        num_prior_output: a continuation of an interrupted run: the prompt's last n tokens are
        its output so far. Penalties count them as output, and its draws continue at position
        n, so with the same seed it samples what the uninterrupted run would have."""
        if request_id in self._seqs:
            raise RequestRejected(
                "invalid_request",
                f"request_id {request_id!r} is already in flight",
                field="request_id",
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(
                "invalid_request",
                f"prompt_token_ids hold ids outside [0, {vocab}): {bad[:5]}",
                field="prompt_token_ids",
            )
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise RequestRejected(
                "invalid_request",
                f"logit_bias names ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                field="logit_bias",
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                "context_length",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} > max_model_len {self.max_model_len}; shorten the prompt or lower "
                "max_tokens",
                field="prompt_token_ids",
            )
        need = self.block_manager.num_blocks_for(total)
        if need > self.block_manager.num_blocks:
            raise RequestRejected(
                "context_length",
                f"prompt + max_tokens = {total} tokens needs {need} KV blocks but the cache has "
                f"{self.block_manager.num_blocks}; raise kv_cache_memory_bytes or num_kv_blocks",
                field="prompt_token_ids",
            )
        grammar = None
        if params.constraint is not None:  # RequestRejected naming the problem if invalid
            grammar = self.grammars.matcher(params.constraint)
            if not grammar.resume(list(constrained_output_ids)):
                raise RequestRejected(
                    "invalid_request",
                    f"constrained_output_ids ({len(constrained_output_ids)} tokens) do not "
                    "follow the request's constraint",
                    field="constrained_output_ids",
                )
        if num_prior_output < 0 or 0 < len(prompt_token_ids) <= num_prior_output:
            raise RequestRejected(
                "invalid_request",
                f"num_prior_output={num_prior_output}: give 0 up to the prompt's length - 1 "
                f"({len(prompt_token_ids) - 1})",
                field="num_prior_output",
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            seed=seed,
            arrival=next(self._arrivals),
            priority=priority,
            cache_domain=cache_domain,
            grammar=grammar,
            num_prior_output=num_prior_output,
        )
        parent = self._seqs.get(fork_of) if fork_of is not None else None
        if (
            parent is not None
            and parent.cache_domain == cache_domain
            and parent.prompt_token_ids == seq.prompt_token_ids
            and parent.params.prompt_logprobs is None  # it computes every prompt position
            and params.prompt_logprobs is None
        ):
            seq.fork_parent = parent
        self._seqs[request_id] = seq
        self._generators[request_id] = torch.Generator(self.device)  # seeded per position
        self.scheduler.add(seq)
        if grammar is not None and grammar.is_complete:  # a resumed run that had ended
            self.scheduler.finish(seq, "stop")
            output = self._emit(seq, 1)
            self._aborted.append(dataclasses.replace(output, new_token_ids=[], new_logprobs=None))
        return seed

    def step(self) -> list[StepOutput]:
        """One iteration: schedule -> run -> sample -> update. Outputs only for requests that
        got a token or ended (aborts since the last step first)."""
        outputs, self._aborted = self._aborted, []
        drafts = propose_drafts(
            self.scheduler.running,
            num_speculative_tokens=self.config.num_speculative_tokens,
            max_rows=self.config.speculative_max_rows,
            max_model_len=self.max_model_len,
        )
        batch = self.scheduler.schedule(drafts)
        self._num_step_tokens = batch.num_batched_tokens
        if batch.is_empty:
            return outputs
        chunks = [s for s in batch.scheduled if s.samples]
        # every row plain greedy: the runner gives each row's argmax [rows], not its logits
        greedy = self.model.greedy_head is not None and all(
            takes_the_argmax(s.seq.params, s.seq.num_output_tokens, s.seq.grammar is not None)
            for s in chunks
        )
        rows_out, prompt_rows = self.runner.run(batch.scheduled, greedy=greedy)
        for rows in prompt_rows:
            self._add_prompt_logprobs(rows)
        token_ids, logprobs = [], None
        if rows_out is not None and greedy:
            row_ids, start = rows_out.tolist(), 0
            for s in chunks:
                n = 1 + len(s.draft)
                token_ids.append(verify_greedy(s.draft, row_ids[start : start + n]))
                start += n
        elif rows_out is not None:  # [rows, vocab] logits
            masks = self._grammar_masks([s.seq for s in chunks])
            requests = [self._sampling_request(s.seq, masks.get(s.seq)) for s in chunks]
            token_ids, logprobs = sample_and_verify(rows_out, [s.draft for s in chunks], requests)
        updated = self.scheduler.update(batch, token_ids, logprobs, self.model_config.eos_token_id)
        self._follow_grammars([seq for seq, _ in updated])
        return outputs + [self._emit(seq, n) for seq, n in updated]

    @property
    def grammars(self) -> GrammarCache:
        """The model's compiled grammars (its vocabulary for llguidance is built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def _grammar_masks(self, seqs: list[Sequence]) -> dict[Sequence, torch.Tensor]:
        """The next-token bitmask row of each constrained sequence about to sample."""
        constrained = [seq for seq in seqs if seq.grammar is not None]
        if not constrained:
            return {}
        start = time.perf_counter_ns()
        bitmask = torch.from_numpy(self.grammars.fill_masks([seq.grammar for seq in constrained]))
        self._grammar_ns += time.perf_counter_ns() - start
        return dict(zip(constrained, bitmask, strict=True))

    def _follow_grammars(self, seqs: list[Sequence]) -> None:
        """Advance the matchers past the tokens just received; a request whose output is a
        complete match ends here ("stop"): nothing but eos could follow."""
        constrained = [seq for seq in seqs if seq.grammar is not None and not seq.is_finished]
        if not constrained:
            return
        start = time.perf_counter_ns()
        for seq in constrained:
            seq.grammar.follow(seq.output_token_ids)
            if seq.grammar.is_complete:
                self.scheduler.finish(seq, "stop")
        self._grammar_ns += time.perf_counter_ns() - start

    def _sampling_request(
        self, seq: Sequence, token_bitmask: torch.Tensor | None = None
    ) -> SamplingRequest:
        p = seq.params
        stop_ids: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            eos = () if p.ignore_eos else (self.model_config.eos_token_id,)
            stop_ids = eos + p.stop_token_ids
        penalized = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        prompt, output = seq.prompt_token_ids, seq.output_token_ids
        if penalized and seq.num_prior_output:
            cut = len(prompt) - seq.num_prior_output
            prompt, output = prompt[:cut], prompt[cut:] + output
        generator = self._generators[seq.request_id]
        generator.manual_seed(draw_seed(seq.seed, seq.num_prior_output + seq.num_output_tokens))
        return SamplingRequest(
            params=p,
            prompt_token_ids=prompt if penalized else [],
            output_token_ids=output if penalized else [],
            generator=generator,
            stop_ids_while_short=stop_ids,
            token_bitmask=token_bitmask,
        )

    def _add_prompt_logprobs(self, rows: PromptRows) -> None:
        """Each row's prompt token (the one after its position) and its top-n, appended to the
        sequence's prompt logprobs in position order (rows computed again are skipped)."""
        seq, n = rows.seq, rows.seq.params.prompt_logprobs
        assert n is not None, "prompt rows only for requests that asked"
        logprobs = rows.logits.log_softmax(dim=-1)  # [m, vocab]
        targets = torch.tensor(
            seq.prompt_token_ids[rows.start + 1 : rows.start + 1 + logprobs.shape[0]],
            device=logprobs.device,
        )  # [m]
        own = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        top_vals, top_ids = logprobs.topk(max(n, 1), dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for k, (token_id, lp) in enumerate(zip(targets.tolist(), own, strict=True)):
            if rows.start + k != len(seq.prompt_logprobs):
                continue
            seq.prompt_logprobs.append(
                [(token_id, lp), *zip(top_ids[k][:n], top_vals[k][:n], strict=True)]
            )

    def _emit(self, seq: Sequence, num_new: int) -> StepOutput:
        """The output of a sequence that just got `num_new` tokens (more than one when a draft
        was accepted); a finished one is forgotten."""
        if seq.is_finished:
            del self._seqs[seq.request_id]
            del self._generators[seq.request_id]
        want_logprobs = seq.params.logprobs is not None and seq.logprobs
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=seq.token_ids[-num_new:],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            seed=seq.seed,
            new_logprobs=seq.logprobs[-num_new:] if want_logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            prompt_logprobs=(
                seq.prompt_logprobs
                if seq.params.prompt_logprobs is not None and seq.num_output_tokens == num_new
                else None
            ),
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; its final output comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        del self._generators[request_id]
        self.scheduler.finish(seq, "abort")
        self._aborted.append(
            StepOutput(
                request_id=request_id,
                new_token_ids=[],
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                seed=seq.seed,
                new_logprobs=None,
            )
        )
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def request_ids(self) -> list[str]:
        """The requests this engine holds now (waiting or running), in arrival order."""
        return list(self._seqs)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        waste = self.model.decode_counters()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_queries=self.scheduler.num_prefix_queries,
            num_prefix_hits=self.scheduler.num_prefix_hits,
            num_forked_tokens=self.scheduler.num_forked_tokens,
            num_step_tokens=self._num_step_tokens,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_draft_tokens=self.scheduler.num_accepted_draft_tokens,
            grammar_s=self._grammar_ns / 1e9,
            decode_wait_s=waste.wait_ns / 1e9,
            num_decode_redone=waste.num_dropped,
        )
