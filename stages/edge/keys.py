"""The edge's fast key check: API key -> caller (tenant, allowed models, priority), from the
same tenants file the auth stage reads (re-read when it changes; auth stays the authority).

Keys are held only as SHA-256 hashes and compared in constant time (`stages.tenancy.tenants`); the key
itself travels on to the pipeline in the submit (the gateway hashes it) and is never logged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from schemas import settings
from stages.edge.errors import RequestError
from stages.tenancy import tenants

DEFAULT_MODEL = settings.MODEL.default


@dataclass(frozen=True, kw_only=True)
class Caller:
    tenant: str
    api_key: str
    allowed_models: tuple[str, ...] = ()
    priority: str = "interactive"
    deadline_s: float | None = None  # the tenant's wait for a first token (None: the edge's)

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
    def __init__(self, path: Path, default_models: tuple[str, ...] = (DEFAULT_MODEL,)) -> None:
        self.path = path
        self.default_models = default_models
        self._tenants = tenants.Tenants(tenants.TenantsFile())
        self._mtime_ns: int | None = -1

    @classmethod
    def from_env(cls) -> KeyRing:
        return cls(tenants.default_path(), (settings.MODEL.get(),))

    def _refresh(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime_ns:
            self._tenants = tenants.load(self.path)
            self._mtime_ns = mtime

    def lookup(self, api_key: str) -> Caller | None:
        self._refresh()
        found = self._tenants.lookup(tenants.hash_key(api_key))
        if found is None:
            return None
        name, tenant = found
        return Caller(
            tenant=name,
            api_key=api_key,
            allowed_models=tuple(tenant.allowed_models),
            priority=tenant.priority,
            deadline_s=tenant.deadline_s,
        )
