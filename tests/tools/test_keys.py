import subprocess
import sys

from stages.tenancy import tenants
from tools.cli import main


def test_keys_add_prints_a_key_once_and_stores_only_its_hash(tmp_path, capsys):
    path = tmp_path / "tenants.toml"
    assert main(["keys", "add", "acme", "--file", str(path)]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith(tenants.KEY_PREFIX) and len(key) > 30
    assert "shown only now" in err
    stored = path.read_text()
    assert key not in stored
    assert tenants.hash_key(key) in stored
    assert tenants.load(path).lookup(tenants.hash_key(key))[0] == "acme"
    assert main(["keys", "add", "acme", "--file", str(path)]) == 0
    second = capsys.readouterr().out.strip()
    assert second != key
    assert len(tenants.read_file(path).tenants["acme"].key_hashes) == 2


def test_keys_add_refuses_a_bad_tenant_name(tmp_path, capsys):
    assert main(["keys", "add", "no spaces!", "--file", str(tmp_path / "t.toml")]) == 2
    assert "must be 1-64" in capsys.readouterr().err
    assert not (tmp_path / "t.toml").exists()


def test_brigade_keys_is_a_console_command(tmp_path):
    path = tmp_path / "tenants.toml"
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", "keys", "add", "dev2", "--file", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert tenants.load(path).lookup(tenants.hash_key(done.stdout.strip()))[0] == "dev2"
