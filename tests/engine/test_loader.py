"""Loaders: a tiny random Llama written as an HF directory and as a GGUF file loads to the same
model; against transformers when it is installed; the default GGUF's config and options."""

import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from engine.attention import AttentionMetadata
from engine.loader import load_model, read_gguf, resolve_quantization
from engine.weights import resolve_model
from kernels import cpu_attention

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT = [5, 17, 3, 90, 44, 8, 61]


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, v, kv = 64, 128, 96, 2 * 16

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    w = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": 1 + rand(h)}
    w["lm_head.weight"] = rand(v, h)
    for i in range(2):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
        }
    return w


def write_hf_dir(path, weights, config=TINY):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in weights.items()}, str(path / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """How llama.cpp's converter stores attn_q / attn_k (pairs interleaved per head)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, w.shape[1])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, weights):
    """The same tiny model as llama.cpp would write it: Q8_0 / Q4_1 / F16 / F32, q, k permuted."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [
        ("block_count", 2), ("context_length", 128), ("embedding_length", 64),
        ("feed_forward_length", 128), ("attention.head_count", 4),
        ("attention.head_count_kv", 2), ("rope.dimension_count", 16), ("vocab_size", 96),
    ]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
             "lm_head.weight": "output"}  # fmt: skip
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    dequantized = {}
    for name, t in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            gname = f"blk.{i}.{layer[rest.removesuffix('.weight')]}"
        else:
            gname = names[name]
        arr = t.numpy()
        if t.ndim == 1:
            writer.add_tensor(gname + ".weight", arr)
            dequantized[name] = t
            continue
        q = gguf.GGMLQuantizationType
        qtype = q.Q4_1 if "ffn" in gname else q.F16 if "attn_v" in gname else q.Q8_0
        deq = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        dequantized[name] = torch.from_numpy(deq.copy())
        if "attn_q" in gname or "attn_k" in gname:
            arr = llama_cpp_permute(arr, 4 if "attn_q" in gname else 2)
        writer.add_tensor(gname + ".weight", gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def logits_of(model, config, ids):
    """Prefill ids[:-1], then one decode step: the logits of both steps' last tokens."""
    shape = (4, 16, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    table = torch.tensor([[2, 0, -1, -1]], dtype=torch.int32)
    out = []
    for start, end in ((0, len(ids) - 1), (len(ids) - 1, len(ids))):
        attn = AttentionMetadata(
            slot_mapping=torch.arange(2 * 16 + start, 2 * 16 + end),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=table,
            query_lens_cpu=[end - start],
            seq_lens_cpu=[end],
            block_size=16,
        )
        hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), caches, attn)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)  # [len(ids), vocab]


def test_hf_directory_weights_round_trip(tmp_path):
    weights = tiny_weights()
    model, config = load_model(str(write_hf_dir(tmp_path / "hf", weights)), dtype=torch.float32)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert not config.tie_word_embeddings and model.quantization is None
    layer = model.layers[1]
    p = "model.layers.1."
    qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(layer.qkv_proj.weight, qkv)
    assert torch.equal(layer.down_proj.weight, weights[p + "mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert logits_of(model, config, PROMPT).shape == (len(PROMPT), 96)


def test_gguf_with_permuted_qk_loads_to_the_same_model_as_hf_directory(tmp_path):
    weights = tiny_weights(seed=1)
    dequantized = write_gguf(tmp_path / "tiny.gguf", weights)
    gguf_config, gguf_weights = read_gguf(tmp_path / "tiny.gguf")
    for name, t in dequantized.items():
        assert torch.equal(gguf_weights[name], t), name
    gguf_model, _ = load_model(str(tmp_path / "tiny.gguf"), dtype=torch.float32)
    hf_model, hf_config = load_model(
        str(write_hf_dir(tmp_path / "hf", dequantized)), dtype=torch.float32
    )
    assert gguf_config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # f32 in GGUF
    assert replace(gguf_config, rms_norm_eps=hf_config.rms_norm_eps) == hf_config
    # the GGUF model's linears run the block kernels, the directory's a dense matmul: the same
    # weights in another summation order, whose last bits depend on the CPU's vector width
    # (AVX2 moved a logit of 0.016 by 1.3e-6); a wrong permutation moves them by their size
    torch.testing.assert_close(
        logits_of(gguf_model, gguf_config, PROMPT),
        logits_of(hf_model, hf_config, PROMPT),
        atol=1e-5,
        rtol=1e-4,
    )


def test_matches_transformers_on_a_random_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    reference = transformers.LlamaForCausalLM(hf_cfg).eval()
    reference.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    model, config = load_model(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits_of(model, config, PROMPT), expected, atol=1e-5, rtol=1e-5)


def test_bad_directories_are_clear_errors(tmp_path):
    weights = tiny_weights()
    del weights["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 weights, e.g. \['model.layers.0.mlp.up_proj"):
        load_model(str(write_hf_dir(tmp_path / "a", weights)), dtype=torch.float32)
    with pytest.raises(ValueError, match="only Llama models are supported"):
        load_model(
            str(write_hf_dir(tmp_path / "b", tiny_weights(), {**TINY, "model_type": "gpt2",
                                                               "architectures": ["GPT2"]})),
            dtype=torch.float32,
        )  # fmt: skip
    with pytest.raises(ValueError, match="dtype='fp8'; allowed: float32, bfloat16, float16"):
        load_model(str(tmp_path / "a"), dtype="fp8")


def test_default_gguf_config():
    config, weights = read_gguf(resolve_model("smollm2-135m"))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_quantization_option():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", torch.bfloat16, cpu) == "int4-decode"
    assert resolve_quantization("auto", torch.float32, cpu) is None  # fp32 stays exact
    assert resolve_quantization("auto", torch.bfloat16, cuda) is None
    assert resolve_quantization("int8", torch.float32, cpu) == "int8"
    with pytest.raises(
        ValueError, match="allowed: 'auto', None, int8, int4, int8-decode, int4-decode"
    ):
        resolve_quantization("int3", torch.bfloat16, cpu)


def test_batch_invariant_option():
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", torch.bfloat16, cpu, batch_invariant=True) is None
    assert resolve_quantization("int4", torch.bfloat16, cpu, batch_invariant=True) == "int4"
    for q in ("int4-decode", "int8-decode"):
        with pytest.raises(ValueError, match=rf"'{q}' switches kernels with the step's row count"):
            resolve_quantization(q, torch.bfloat16, cpu, batch_invariant=True)
    with pytest.raises(ValueError, match="dtype='float16' on 'cpu'; allowed: dtype 'float32' or"):
        load_model("smollm2-135m", dtype="float16", batch_invariant=True)
    with pytest.raises(ValueError, match="float32 with quantization='int8'; allowed: None or"):
        load_model("smollm2-135m", dtype="float32", quantization="int8", batch_invariant=True)
    with pytest.raises(RuntimeError, match="in float32 runs every linear on the block GEMV"):
        load_model("smollm2-135m", dtype="float32", batch_invariant=True, quantized_gemv=False)
    model, _ = load_model("smollm2-135m", dtype="float32", batch_invariant=True)
    assert model.lm_head.invariant and model.layers[0].down_proj.invariant


def test_fp32_batch_invariant_needs_every_linear_as_blocks(tmp_path):
    hf_dir = write_hf_dir(tmp_path / "hf", tiny_weights())  # safetensors: no blocks at all
    with pytest.raises(ValueError, match=r"float32 runs every linear on the GGUF file's Q4_1"):
        load_model(str(hf_dir), dtype="float32", batch_invariant=True)


def test_batch_invariant_without_the_kernel_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the compiled CPU attention kernel"):
        load_model("smollm2-135m", dtype="bfloat16", batch_invariant=True)
