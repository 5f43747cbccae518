"""The edge's fast key check: API key -> caller (tenant and allowed models), from the same
tenants file the auth stage reads (the auth stage stays the authority).

Keys are held only as SHA-256 hashes and compared in constant time; the key itself travels on
to the pipeline in the submit (the gateway hashes it) and is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from stages.openai_compat import RequestError


def key_hash(api_key: str) -> str:
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class TenantPolicy:
    name: str
    allowed_models: tuple[str, ...] = ()  # empty: every served model
    priority: str = "interactive"  # or "batch"


@dataclass(frozen=True, kw_only=True)
class Caller:
    tenant: str
    api_key: str
    allowed_models: tuple[str, ...] = ()
    priority: str = "interactive"

    def __repr__(self) -> str:  # never print the key
        return f"Caller(tenant={self.tenant!r}, allowed_models={self.allowed_models!r})"

    def check_model(self, model: str | None) -> None:
        if model is None or not self.allowed_models or model in self.allowed_models:
            return
        raise RequestError(
            "forbidden",
            f"tenant {self.tenant!r} may not use model {model!r}; allowed: "
            f"{', '.join(self.allowed_models)}",
            "model",
        )

    def models(self, served: Iterable[str]) -> list[str]:
        return [m for m in served if not self.allowed_models or m in self.allowed_models]


class KeyRing:
    def __init__(
        self, hashes: dict[str, TenantPolicy], default_models: tuple[str, ...] = ()
    ) -> None:
        self._hashes = hashes
        self.default_models = default_models

    def lookup(self, api_key: str) -> Caller | None:
        digest = key_hash(api_key)
        found: TenantPolicy | None = None
        for stored, policy in self._hashes.items():  # constant time per entry, no early exit
            if hmac.compare_digest(stored, digest):
                found = policy
        if found is None:
            return None
        return Caller(
            tenant=found.name,
            api_key=api_key,
            allowed_models=found.allowed_models,
            priority=found.priority,
        )
