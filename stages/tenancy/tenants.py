"""Tenants and their API keys (`tenants.toml`): keys are stored only as SHA-256 hashes.

A lookup hashes the presented key and compares it with every stored hash in constant time, so
neither timing nor an early exit tells which tenant or how much matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import tomli_w
from msgspec import Meta

from schemas import settings
from schemas.events import DeadlineS
from stages.runtime import natsd

DEV_TENANT = "dev"
DEV_KEY_FILE = "dev.key"  # the dev key for a second terminal; mode 0600, beside tenants.toml
KEY_PREFIX = "brg-"

KeyHash = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
Positive = Annotated[int, Meta(ge=1)]


class Tenant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tenant's keys and settings; a None limit means unlimited."""

    key_hashes: list[KeyHash] = []
    requests_per_min: Positive | None = None
    tokens_per_min: Positive | None = None
    max_concurrent: Positive | None = None
    max_output_tokens: Positive | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    allowed_models: list[str] = []  # empty: every served model
    # seconds its requests may wait for a first token unless they say (None: the edge's default)
    deadline_s: DeadlineS | None = None


class TenantsFile(msgspec.Struct, kw_only=True, omit_defaults=True):
    tenants: dict[Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")], Tenant] = {}


def hash_key(api_key: str) -> str:
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(24)


def default_path() -> Path:
    return settings.TENANTS.get() or natsd.default_data_dir() / "tenants.toml"


class Tenants:
    """The tenants of one file, indexed for constant-time key checks."""

    def __init__(self, file: TenantsFile) -> None:
        self.by_name = dict(file.tenants)
        self._hashes = [
            (h.encode(), name) for name, t in file.tenants.items() for h in t.key_hashes
        ]

    def lookup(self, key_hash: str | None) -> tuple[str, Tenant] | None:
        """(name, tenant) whose key hashes to `key_hash`; compares against every stored hash."""
        if key_hash is None:
            return None
        probe = key_hash.encode()
        found: str | None = None
        for stored, name in self._hashes:
            if hmac.compare_digest(stored, probe):
                found = name
        return None if found is None else (found, self.by_name[found])


def read_file(path: Path) -> TenantsFile:
    """Parse and validate; errors name the file and the offending field."""
    if not path.exists():
        return TenantsFile()
    try:
        return msgspec.toml.decode(path.read_bytes(), type=TenantsFile)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ValueError(f"{path}: {err}") from err


def load(path: Path | None = None) -> Tenants:
    return Tenants(read_file(path or default_path()))


def write_file(path: Path, file: TenantsFile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(tomli_w.dumps(msgspec.to_builtins(file)))
    tmp.replace(path)


def add_key(tenant: str, *, path: Path | None = None, api_key: str | None = None) -> str:
    """Store the hash of `api_key` (or of a new key) for `tenant`; returns the key, shown once."""
    path = path or default_path()
    key = api_key or new_key()
    file = read_file(path)
    current = file.tenants.get(tenant, Tenant())
    digest = hash_key(key)
    if digest not in current.key_hashes:
        file.tenants[tenant] = msgspec.structs.replace(
            current, key_hashes=[*current.key_hashes, digest]
        )
        write_file(path, file)
    return key


def provision_dev(path: Path | None = None) -> tuple[str, bool]:
    """The dev tenant's key for `brigade up`: BRIGADE_API_KEY, else the saved one, else a new one.

    Returns (key, generated). The key's hash goes into tenants.toml; the key itself is saved in
    dev.key (mode 0600) beside it so `brigade ask` in another terminal can use it.
    """
    path = path or default_path()
    key_file = path.parent / DEV_KEY_FILE
    key = settings.API_KEY.get()
    generated = False
    if not key and key_file.exists():
        key = key_file.read_text().strip()
    if not key:
        key, generated = new_key(), True
    add_key(DEV_TENANT, path=path, api_key=key)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, generated


def dev_key(path: Path | None = None) -> str | None:
    """The key `brigade ask` uses: BRIGADE_API_KEY, else the one `brigade up` saved."""
    key = settings.API_KEY.get()
    if key:
        return key
    key_file = (path or default_path()).parent / DEV_KEY_FILE
    return key_file.read_text().strip() if key_file.exists() else None
