import json

from tools.cli import main


def test_kv_estimate_prints_formula_and_bytes(capsys):
    assert main(["kv-estimate", "--tokens", "8192", "--batch", "4", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "2 x 30 layers x 4 seqs x 3 kv_heads x 8192 tokens x 64 head_dim x 2 bytes" in out
    assert "= 754,974,720 bytes (720.00 MiB)" in out


def test_kv_estimate_json(capsys):
    assert main(["kv-estimate", "--tokens", "1000", "--dtype", "float32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes"] == 46_080_000 and result["bytes_per_token"] == 46_080
    assert result["bytes_without_gqa"] == 3 * 46_080_000


def test_kv_estimate_bad_input_is_a_message_not_a_crash(capsys):
    assert main(["kv-estimate", "--tokens", "0"]) == 2
    assert "--tokens=0: must be >= 1" in capsys.readouterr().out
    assert main(["kv-estimate", "--tokens", "5", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().out
