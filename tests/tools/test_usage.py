from schemas.events import RequestFailed, RunCancelled, RunCompleted, Usage
from stages import ledger
from tools.cli import main


def test_usage_sums_per_tenant_and_status(tmp_path, capsys):
    db = tmp_path / "ledger.duckdb"
    u = Usage(prompt_tokens=10, completion_tokens=4)
    ledger.write_rows(db, [
        ledger.row_for(RunCompleted(request_id="a", tenant="acme", finish_reason="stop", usage=u)),
        ledger.row_for(RunCompleted(request_id="b", tenant="acme", finish_reason="length", usage=u)),
        ledger.row_for(RunCancelled(request_id="c", tenant="acme", usage=Usage(prompt_tokens=10, completion_tokens=1))),
        ledger.row_for(RequestFailed(request_id="d", tenant="globex", stage="auth", code="rate_limited", message="x")),
    ])  # fmt: skip
    assert main(["usage", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tenant", "status", "runs", "prompt_tokens", "completion_tokens"]
    assert [line.split() for line in lines[2:]] == [
        ["acme", "cancelled", "1", "10", "1"],
        ["acme", "completed", "2", "20", "8"],
        ["globex", "failed", "1", "0", "0"],
    ]
    assert main(["usage", "--db", str(db), "--tenant", "globex"]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines()[2:]] == [
        ["globex", "failed", "1", "0", "0"]
    ]


def test_usage_without_a_ledger_says_where_it_looked(tmp_path, capsys):
    assert main(["usage", "--db", str(tmp_path / "none.duckdb")]) == 1
    assert "no ledger at" in capsys.readouterr().err
