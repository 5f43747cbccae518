"""Tokenizer: ids and chat template text equal transformers' (committed table), no torch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tokenizer import load_tokenizer

REFERENCE = json.loads(
    (Path(__file__).parents[1] / "data" / "hf_greedy_reference.json").read_text()
)
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("case", REFERENCE["tokenizer"], ids=lambda c: c["text"][:12])
def test_ids_match_transformers(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


def test_ascii_emoji_cjk_round_trip(tok):
    for case in REFERENCE["tokenizer"]:
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]
    assert tok.encode("Hello world!") == [19556, 905, 17]
    assert tok.encode("😀") == [10813, 242, 218]  # three byte-level pieces


@pytest.mark.parametrize(
    "conv", REFERENCE["conversations"], ids=lambda c: str(len(c["prompt_ids"]))
)
def test_chat_template_text_and_ids_match_transformers(tok, conv):
    assert tok.apply_chat_template(conv["messages"]) == conv["prompt_text"]
    assert tok.encode_chat(conv["messages"]) == conv["prompt_ids"]


def test_chat_template_without_generation_prompt(tok):
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}], add_generation_prompt=False
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n"


def test_special_tokens(tok):
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.max_model_len == 8192 and tok.model_name == "smollm2-135m"
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.encode("<|im_start|>hi<|im_end|>") == [1, 6004, 2]  # no bos is ever added
    assert tok.decode([1, 6004, 2]) == "hi"
    assert tok.decode([1, 6004, 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_bad_input_is_a_clear_error(tok):
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a str, got int"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.role must be a str, got NoneType"):
        tok.encode_chat([{"content": "a"}])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match="registered names"):
        load_tokenizer("no-such-model")


def test_loading_is_fast_and_never_imports_torch():
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from engine.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer('smollm2-135m'); tok.encode_chat([{'role': 'user', 'content': 'x'}])\n"
        "print(time.perf_counter() - t); assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 3.0  # ~0.3 s on an idle core; generous for a shared machine


def test_hf_directory_tokenizer_matches_gguf_tokenizer(tok, tmp_path):
    tok._backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
            }
        )
    )
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # resolve_model only checks it exists
    hf = load_tokenizer(str(tmp_path))
    assert (hf.bos_token_id, hf.eos_token_id, hf.max_model_len) == (1, 2, 2048)
    for conv in REFERENCE["conversations"]:
        assert hf.encode_chat(conv["messages"]) == conv["prompt_ids"]
