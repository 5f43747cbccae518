"""Auth and tenants: hashed keys, unknown key -> unauthorized, tenant settings, dev provisioning."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from schemas import settings
from schemas.events import Message, Request, RequestAccepted, Sampling
from stages import auth
from stages.runtime.failures import StageError
from stages.tenancy import tenants


def accepted(key: str | None, *, model: str | None = None, max_tokens: int = 16, priority=None):
    return RequestAccepted(
        request_id="r1",
        request=Request(
            messages=[Message(role="user", content="hi")],
            model=model,
            priority=priority,
            sampling=Sampling(max_tokens=max_tokens),
        ),
        key_hash=tenants.hash_key(key) if key else None,
    )


@pytest.fixture
def tenants_path(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(
        "[tenants.acme]\n"
        f'key_hashes = ["{tenants.hash_key("acme-key")}"]\n'
        'allowed_models = ["smollm2-135m"]\n'
        "max_output_tokens = 64\n"
        "requests_per_min = 60\n"
        "[tenants.nightly]\n"
        f'key_hashes = ["{tenants.hash_key("night-key")}"]\n'
        'priority = "batch"\n'
    )
    return path


def test_file_holds_only_hashes_and_lookup_finds_tenant(tenants_path: Path) -> None:
    key = tenants.add_key("acme", path=tenants_path)
    text = tenants_path.read_text()
    assert key not in text and "acme-key" not in text
    assert hashlib.sha256(key.encode()).hexdigest() in text
    loaded = tenants.load(tenants_path)
    name, tenant = loaded.lookup(tenants.hash_key(key))
    assert name == "acme" and len(tenant.key_hashes) == 2 and tenant.requests_per_min == 60
    assert tenant.max_output_tokens == 64  # settings survive the rewrite
    assert loaded.lookup(tenants.hash_key("nope")) is None and loaded.lookup(None) is None


def test_bad_tenants_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.x]\nkey_hashes = ["md5:abc"]\n')
    with pytest.raises(
        ValueError,
        match=r"tenants\.toml: Expected `str` matching regex .* - at `\$\.tenants\[\.\.\.\]\.key_hashes\[0\]`",
    ):
        tenants.load(path)


def test_authorize_sets_tenant_and_priority(tenants_path: Path) -> None:
    state = auth.AuthState(tenants_path)
    out = auth.authorize(accepted("acme-key", model="smollm2-135m"), state)
    assert (out.request_id, out.tenant, out.priority) == ("r1", "acme", "interactive")
    assert auth.authorize(accepted("acme-key", priority="batch"), state).priority == "batch"
    assert auth.authorize(accepted("night-key", priority="interactive"), state).priority == "batch"


@pytest.mark.parametrize(
    ("key", "kw", "code", "field", "message"),
    [
        (
            "stolen",
            {},
            "unauthorized",
            "api_key",
            "the API key is not known; send a key issued by `brigade keys add TENANT` (the `dev` tenant's key is printed by `brigade up`)",
        ),
        (
            None,
            {},
            "unauthorized",
            "api_key",
            "no API key was given; send a key issued by `brigade keys add TENANT` (the `dev` tenant's key is printed by `brigade up`)",
        ),
        (
            "acme-key",
            {"model": "big"},
            "forbidden",
            "model",
            "tenant 'acme' may not use model 'big'; allowed: smollm2-135m",
        ),
        (
            "acme-key",
            {"max_tokens": 65},
            "invalid_request",
            "max_tokens",
            "max_tokens=65 is above tenant 'acme''s max_output_tokens=64; lower max_tokens",
        ),
    ],
)
def test_refusals(tenants_path: Path, key, kw, code, field, message) -> None:
    with pytest.raises(StageError) as info:
        auth.authorize(accepted(key, **kw), auth.AuthState(tenants_path))
    assert (info.value.code, info.value.field, info.value.message) == (code, field, message)
    assert "stolen" not in info.value.message


def test_new_key_works_without_restart(tenants_path: Path) -> None:
    state = auth.AuthState(tenants_path)
    key = tenants.add_key("nightly", path=tenants_path)
    os.utime(tenants_path, ns=(1, 1))  # mtime change even within one clock tick
    assert auth.authorize(accepted(key), state).tenant == "nightly"


def test_provision_dev_from_env_or_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tenants.toml"
    monkeypatch.delenv(settings.API_KEY.name, raising=False)
    key, generated = tenants.provision_dev(path)
    assert generated and key.startswith("brg-") and len(key) == 36
    assert tenants.provision_dev(path) == (key, False)  # the saved key is reused
    assert stat.S_IMODE((tmp_path / "dev.key").stat().st_mode) == 0o600
    assert tenants.dev_key(path) == key
    monkeypatch.setenv(settings.API_KEY.name, "from-env")
    assert tenants.provision_dev(path) == ("from-env", False)
    loaded = tenants.load(path)
    assert loaded.lookup(tenants.hash_key("from-env"))[0] == "dev"
    assert loaded.lookup(tenants.hash_key(key))[0] == "dev"
