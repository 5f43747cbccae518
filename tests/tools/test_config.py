from schemas import settings
from tools import cli, config


def test_prints_each_value_its_source_and_help(monkeypatch, capsys):
    monkeypatch.setenv("BRIGADE_EDGE_PORT", "9000")
    monkeypatch.setenv("BRIGADE_API_KEY", "brg-secret")
    monkeypatch.delenv("BRIGADE_EDGE_HOST", raising=False)
    monkeypatch.delenv("BRIGADE_ARCHIVE_DIR", raising=False)
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    port = next(i for i, line in enumerate(lines) if line.startswith("BRIGADE_EDGE_PORT "))
    assert "9000  [env; read by edge, up]" in lines[port]
    assert lines[port + 1].strip() == settings.EDGE_PORT.help
    assert "127.0.0.1  [default; read by edge]" in out
    assert "(set, not shown)" in out and "brg-secret" not in out
    assert "($BRIGADE_DATA_DIR/archive)  [default; read by archiver, log]" in out


def test_service_filters_to_what_it_reads(capsys):
    assert cli.main(["config", "--service", "ledger"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:1] != " "]
    assert names == [s.name for s in settings.for_reader("ledger")]
    assert "BRIGADE_LEDGER_DB" in names and "BRIGADE_EDGE_PORT" not in names


def test_an_invalid_value_exits_2_naming_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("BRIGADE_ACK_WAIT_S", "abc")
    monkeypatch.setenv("BRIGADE_EDGE_PROT", "9000")
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert "BRIGADE_ACK_WAIT_S='abc': not a number" in err
    assert "did you mean BRIGADE_EDGE_PORT?" in err
    tenants = tmp_path / "tenants.toml"
    assert cli.main(["keys", "add", "t", "--file", str(tenants)]) == 2  # checked before it runs
    assert not tenants.exists()
    assert "brigade keys: BRIGADE_ACK_WAIT_S='abc'" in capsys.readouterr().err


def test_markdown_and_readme_rewrite(tmp_path, capsys):
    assert cli.main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown_table()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{config.BEGIN}\nstale\n{config.END}\n\nafter\n")
    assert cli.main(["config", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert config.readme_table(text) == settings.markdown_table()
    assert text.startswith("# x\n\n") and text.endswith(f"{config.END}\n\nafter\n")
    assert config.with_table(text) == text
