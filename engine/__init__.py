"""Brigade's inference engine: a synchronous core (no I/O) over a paged KV cache.

Exports are lazy (PEP 562) so that `import engine.tokenizer` never loads torch.
"""

import os
from importlib import import_module
from typing import Any

# Before torch loads (its OpenMP runtime reads this once): idle pool threads spin a bounded while
# (GOMP_SPINCOUNT, ~100 us here), then sleep. libgomp's default spin (300k) beside the stages and
# nats-server on two cores starves them and stalls each op on a descheduled peer; sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) halves single-stream decode on an idle machine (measured in
# docs/benchmarks.md). A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT stands.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

_EXPORTS: dict[str, str] = {
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "SamplingParams": "engine.params",
    "Engine": "engine.engine",
    "EngineConfig": "engine.engine",
    "StepOutput": "engine.engine",
    "EngineStats": "engine.engine",
    "ModelConfig": "engine.config",
    "AttentionMetadata": "engine.attention",
    "LlamaForCausalLM": "engine.model",
    "load_model": "engine.loader",
    "Tokenizer": "engine.tokenizer",
    "load_tokenizer": "engine.tokenizer",
    "resolve_model": "engine.weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
