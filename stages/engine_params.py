"""The engine stage's pure parts: the admission rule, seeds, wire Sampling -> engine
SamplingParams, and the EngineConfig from BRIGADE_* variables."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestRejected
from schemas import models, settings
from schemas.events import Sampling
from stages.runtime.failures import StageError


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """When the stage pulls more work: never past these bounds (the rest waits in the durable,
    where any other engine worker may take it)."""

    max_active: int = 64  # requests held by this worker (running + waiting in the engine)
    kv_watermark: float = 0.95  # no new work while this fraction of KV blocks is in use
    max_fetch: int = 16  # most messages taken at once (the stage's drain_s is in its spec)

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.max_fetch < 1:
            raise ValueError(f"max_active={self.max_active}, max_fetch={self.max_fetch}: >= 1")
        if not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError(f"kv_watermark={self.kv_watermark}; allowed: 0 < x <= 1")


def admission_room(
    *, num_free_blocks: int, num_total_blocks: int, reserved_blocks: int, num_active: int,
    config: AdmissionConfig, blocks_per_request: int = 1,
) -> int:  # fmt: skip
    """How many `tokenized` messages to pull now (0: wait for capacity).

    `reserved_blocks` are the blocks that admitted requests whose prompts are not computed yet
    will take; they count as used, so a burst never oversubscribes the cache.
    `blocks_per_request`: what one more request is expected to take (its prompt's blocks; the
    stage's mean). Only as many are pulled as fit in the free blocks, so the rest stay in the
    durable for a worker with room; an idle worker takes one whatever its size.
    """
    if num_active >= config.max_active:
        return 0
    if num_active == 0:
        fits = max(1, num_free_blocks // max(1, blocks_per_request))
        return min(config.max_fetch, config.max_active, fits)
    free = num_free_blocks - reserved_blocks
    usage = 1.0 - free / num_total_blocks
    if free <= 0 or usage >= config.kv_watermark:
        return 0
    fits = free // max(1, blocks_per_request)
    return min(config.max_fetch, config.max_active - num_active, fits)


def derived_seed(request_id: str) -> int:
    """The seed of a request that gave none: fixed by its id, so a re-run samples the same."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def sampling_params(sampling: Sampling, request_id: str) -> Any:
    """Wire Sampling -> engine.SamplingParams; StageError naming the field when out of range."""
    from engine import SamplingParams

    try:
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            seed=derived_seed(request_id) if sampling.seed is None else sampling.seed,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs,
            logit_bias=sampling.logit_bias or {},
            constraint=constraint(sampling),
        )
    except RequestRejected as err:
        raise rejected(err) from err


CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip


def constraint(sampling: Sampling) -> Any:
    """The engine Constraint of the wire's structured-output fields (None: free text).
    RequestRejected naming the field when more than one is given or one is malformed; whether
    it compiles is engine.grammar.check's (the gateway's) and add_request's to say."""
    from engine.params import Constraint

    given = [name for name in CONSTRAINT_FIELDS if getattr(sampling, name) is not None]
    fmt = sampling.response_format
    if fmt is not None and fmt.type == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise RequestRejected(
            "invalid_request",
            f"give at most one structured-output field; got {', '.join(given)}",
            field=given[1],
        )
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise RequestRejected(
            "invalid_request",
            'response_format type "json_schema" needs json_schema: {"name", "schema"}',
            field="response_format.json_schema",
        )
    try:
        if fmt is not None and fmt.type == "json_object":
            return Constraint("json_object")
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema
            return Constraint("json_object") if schema is None else Constraint.json_schema(schema)
        if sampling.guided_json is not None:
            return Constraint.json_schema(sampling.guided_json)
        if sampling.guided_regex is not None:
            return Constraint("regex", sampling.guided_regex)
        if sampling.guided_choice is not None:
            return Constraint.choice(sampling.guided_choice)
        if sampling.guided_grammar is not None:
            return Constraint("grammar", sampling.guided_grammar)
    except RequestRejected as err:  # "SamplingParams.constraint.spec is not valid JSON ..."
        field = "response_format.json_schema" if given == ["response_format"] else given[0]
        raise RequestRejected(err.code, f"{field}: {err.message}", field=field) from err
    return None


def rejected(err: RequestRejected) -> StageError:
    """The engine's refusal of a request as the stage's `failed` reason: its code and field."""
    return StageError(err.code, err.message, field=err.field)


def engine_config_from_env() -> Any:
    """EngineConfig from BRIGADE_* variables (the model BRIGADE_ENGINE_MODEL names of
    BRIGADE_MODEL's, dtype, device, KV budget, batch limits, batch-invariant mode, prefix
    caching, speculative decoding)."""
    from engine import EngineConfig

    found = settings.load()
    configure_kernels(found)
    kwargs: dict[str, Any] = {}
    if found.source(settings.MODEL) == "env":  # this worker's one model of the served ones
        kwargs["model"] = models.engine_model().artifact
    for setting, name in (
        (settings.DTYPE, "dtype"),
        (settings.KV_CACHE_DTYPE, "kv_cache_dtype"),
        (settings.DEVICE, "device"),
        (settings.KV_CACHE_BYTES, "kv_cache_memory_bytes"),
        (settings.NUM_KV_BLOCKS, "num_kv_blocks"),
        (settings.MAX_NUM_SEQS, "max_num_seqs"),
        (settings.MAX_NUM_BATCHED_TOKENS, "max_num_batched_tokens"),
        (settings.MAX_MODEL_LEN, "max_model_len"),
        (settings.BATCH_INVARIANT, "batch_invariant"),
        (settings.PREFIX_CACHING, "enable_prefix_caching"),
        (settings.NUM_SPECULATIVE_TOKENS, "num_speculative_tokens"),
        (settings.QUANTIZED_GEMV, "quantized_gemv"),
        (settings.FUSED_DECODE, "fused_decode"),
        (settings.SCREENED_HEAD, "screened_head"),
        (settings.AMX_PREFILL, "amx_prefill"),
    ):
        if found.source(setting) == "env":  # else EngineConfig's own default (the same)
            kwargs[name] = found[setting]
    # the served engine caches prefixes unless told not to (as SGLang's radix cache and vLLM's
    # automatic prefix caching are on when serving); each tenant is its own cache domain
    kwargs["enable_prefix_caching"] = found[settings.PREFIX_CACHING]
    return EngineConfig(**kwargs)


def configure_kernels(found: settings.Settings | None = None) -> None:
    """The CPU attention kernel's switch, compiler and cache, and the quantized GEMV's, GEMM's,
    AMX GEMM's, fused decode forward's and screened head's compiler and cache (their switches
    are EngineConfig's quantized_gemv, amx_prefill, fused_decode and screened_head), from
    settings."""
    from kernels import (
        cpu_amx_gemm,
        cpu_attention,
        cpu_causal_attention,
        cpu_decode,
        cpu_greedy_head,
        cpu_quant_gemm,
        cpu_quant_gemv,
    )

    found = found or settings.load()
    cpu_attention.configure(
        cpu_attention.KernelOptions(
            enabled=found[settings.CPU_KERNEL],
            compiler=found[settings.CC],
            cache_root=found[settings.XDG_CACHE_HOME],
        )
    )
    cpu_causal_attention.configure(
        cpu_causal_attention.CausalOptions(
            enabled=found[settings.CPU_KERNEL],
            compiler=found[settings.CC],
            cache_root=found[settings.XDG_CACHE_HOME],
        )
    )
    cpu_quant_gemv.configure(
        cpu_quant_gemv.GemvOptions(
            compiler=found[settings.CC], cache_root=found[settings.XDG_CACHE_HOME]
        )
    )
    cpu_quant_gemm.configure(
        cpu_quant_gemm.GemmOptions(
            compiler=found[settings.CC], cache_root=found[settings.XDG_CACHE_HOME]
        )
    )
    cpu_amx_gemm.configure(
        cpu_amx_gemm.AmxGemmOptions(
            compiler=found[settings.CC], cache_root=found[settings.XDG_CACHE_HOME]
        )
    )
    cpu_decode.configure(
        cpu_decode.DecodeOptions(
            compiler=found[settings.CC], cache_root=found[settings.XDG_CACHE_HOME]
        )
    )
    cpu_greedy_head.configure(
        cpu_greedy_head.HeadOptions(
            compiler=found[settings.CC], cache_root=found[settings.XDG_CACHE_HOME]
        )
    )
