"""Auth: `accepted` -> `authorized`. The API key's hash names the tenant; its settings apply.

An unknown or missing key fails the request as `unauthorized`; a model outside the tenant's list
as `forbidden`; max_tokens above the tenant's cap as `invalid_request`. The tenants file is
re-read when it changes, so a key added by `brigade keys add` works without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from schemas import subjects
from schemas.events import (
    Event,
    RequestAccepted,
    RequestAuthorized,
    RequestFailed,
    decoder_for,
)
from stages.runtime.failures import StageError
from stages.runtime.spec import StageContext, StageSpec
from stages.tenancy import idempotency, ratelimit, tenants

STAGE = "auth"


@dataclass
class AuthState:
    """The tenants file, reloaded when its modification time changes."""

    path: Path
    tenants: tenants.Tenants = field(init=False)
    _mtime_ns: int | None = field(init=False, default=None)
    limiter: ratelimit.RateLimiter | None = None
    idempotency_keys: idempotency.IdempotencyStore | None = None

    def __post_init__(self) -> None:
        self.tenants = tenants.Tenants(tenants.TenantsFile())
        self.refresh()

    def refresh(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime_ns:
            self.tenants = tenants.load(self.path)
            self._mtime_ns = mtime


def authorize(event: RequestAccepted, state: AuthState) -> RequestAuthorized:
    state.refresh()
    found = state.tenants.lookup(event.key_hash)
    if found is None:
        why = "no API key was given" if event.key_hash is None else "the API key is not known"
        raise StageError(
            "unauthorized",
            f"{why}; send a key issued by `brigade keys add TENANT` (the `dev` tenant's key is "
            "printed by `brigade up`)",
            field="api_key",
        )
    name, tenant = found
    request = event.request
    if request.model is not None and tenant.allowed_models:
        if request.model not in tenant.allowed_models:
            raise StageError(
                "forbidden",
                f"tenant {name!r} may not use model {request.model!r}; allowed: "
                f"{', '.join(tenant.allowed_models)}",
                field="model",
            )
    max_tokens = request.sampling.max_tokens
    if tenant.max_output_tokens is not None and max_tokens > tenant.max_output_tokens:
        raise StageError(
            "invalid_request",
            f"max_tokens={max_tokens} is above tenant {name!r}'s max_output_tokens="
            f"{tenant.max_output_tokens}; lower max_tokens",
            field="max_tokens",
        )
    # A batch tenant cannot ask for interactive scheduling; anyone may ask for batch.
    priority = "batch" if "batch" in (tenant.priority, request.priority) else "interactive"
    return RequestAuthorized(
        request_id=event.request_id, tenant=name, request=request, priority=priority
    )


async def admit(event: RequestAuthorized, state: AuthState) -> None:
    """Idempotency key, then the tenant's rate limits (shared KV); a refused run frees its key."""
    store = state.idempotency_keys
    claimed = store is not None and await idempotency.claim_authorized(store, event)
    if state.limiter is None:
        return
    try:
        await ratelimit.admit_authorized(state.limiter, event, state.tenants.by_name[event.tenant])
    except StageError:
        if claimed:
            await store.release(event.tenant, event.request.idempotency_key, event.request_id)
        raise


async def handle(event: RequestAccepted, state: AuthState) -> list[Event]:
    authorized = authorize(event, state)
    try:
        await admit(authorized, state)
    except StageError as err:  # refused for a known tenant: the failure names it
        return [
            RequestFailed(
                request_id=event.request_id,
                tenant=authorized.tenant,
                stage=STAGE,
                code=err.code,  # type: ignore[arg-type]
                message=err.message,
                field=err.field,
                retry_after_s=err.retry_after_s,
            )
        ]
    return [authorized]


async def setup(ctx: StageContext) -> AuthState:
    state = AuthState(tenants.default_path())
    await ctx.bus.ensure_kv()
    state.limiter = ratelimit.RateLimiter(await ctx.bus.kv(subjects.RATES_BUCKET))
    state.idempotency_keys = idempotency.IdempotencyStore(
        await ctx.bus.kv(subjects.IDEMPOTENCY_BUCKET)
    )
    return state


SPEC = StageSpec(
    name=STAGE,
    input_event="accepted",
    decoder=decoder_for(RequestAccepted),
    handle=handle,
    setup=setup,
)
