"""fp32 linears over the default GGUF's own blocks: the blocks hold exactly the weights read_gguf
dequantizes (un-permuted q/k included), steps of <= 8 rows run the block GEMV, more rows the
block GEMM (the dense GEMM where it was not built), and load_model picks them only for fp32
dense on the CPU with the kernel built."""

import pytest
import torch

import engine.loader as loader
from engine.gguf_linear import GEMV_MAX_ROWS, GGUFBlocks, GGUFLinear, concat_blocks
from engine.quant import DenseLinear
from engine.weights import resolve_model
from kernels import cpu_amx_gemm, cpu_quant_gemm, cpu_quant_gemv

pytestmark = pytest.mark.skipif(
    not cpu_quant_gemv.available(), reason="no C compiler to build the quantized GEMV"
)
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def gguf_model():
    path = resolve_model(MODEL)
    config, weights = loader.read_gguf(path)
    return config, weights, loader.read_gguf_blocks(path, config)


def test_the_blocks_hold_read_ggufs_weights_bit_for_bit(gguf_model):
    config, weights, blocks = gguf_model
    assert len(blocks) == 7 * config.num_layers + 1  # every matrix, and the tied head
    assert blocks["model.embed_tokens.weight"].kind == "q8_0"
    for i in (0, config.num_layers - 1):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            key = f"model.layers.{i}.{name}.weight"
            assert blocks[key].kind == "q4_1"
            got = cpu_quant_gemv.dequantize(blocks[key].data, "q4_1")
            assert torch.equal(got, weights[key]), key  # q / k rows un-permuted alike
    embed = blocks["model.embed_tokens.weight"]
    want = weights["model.embed_tokens.weight"]
    assert torch.equal(cpu_quant_gemv.dequantize(embed.data, "q8_0"), want)


@pytest.mark.parametrize(
    ("key", "kind"),
    [("model.layers.3.mlp.down_proj.weight", "q4_1"), ("model.embed_tokens.weight", "q8_0")],
)
def test_decode_rows_take_the_block_gemv_and_more_rows_the_block_gemm(gguf_model, key, kind):
    _, weights, blocks = gguf_model
    dense = DenseLinear(weights[key])
    linear = GGUFLinear(blocks[key], dense)
    assert linear.gemm and blocks[key].kind == kind
    assert linear.dense is None  # every step has a kernel: the fp32 copy is not kept
    x = torch.randn(65, weights[key].shape[1])
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 65):
        got = linear(x[:rows])
        kernel = cpu_quant_gemv.quant_gemv if rows <= GEMV_MAX_ROWS else cpu_quant_gemm.quant_gemm
        assert torch.equal(got, kernel(x[:rows], blocks[key].data, kind))
        torch.testing.assert_close(got, x[:rows] @ weights[key].t(), atol=1e-4, rtol=1e-5)
    no_gemm = GGUFLinear(blocks[key], dense, gemm=False)  # the GEMM could not be built
    assert no_gemm.dense is dense
    assert torch.equal(no_gemm(x), dense(x))
    assert torch.equal(no_gemm(x[:1]), linear(x[:1]))
    assert linear(x[:0]).shape == (0, weights[key].shape[0])
    half = x[:3].to(torch.bfloat16)  # another dtype: computed in fp32, returned in its own
    assert linear(half).dtype == torch.bfloat16
    assert torch.equal(linear(half), linear(half.float()).to(torch.bfloat16))


def test_the_invariant_linear_takes_the_block_gemv_at_every_row_count(gguf_model):
    """The batch-invariant mode: a row's result is the same bits alone, in a decode group or in
    a 65-row prefill chunk, at any place in it."""
    _, weights, blocks = gguf_model
    key = "model.layers.3.mlp.down_proj.weight"
    linear = GGUFLinear(blocks[key], DenseLinear(weights[key]), invariant=True)
    x = torch.randn(65, weights[key].shape[1])
    alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 65):
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    assert torch.equal(linear(x[7:40]), alone[7:40])
    torch.testing.assert_close(alone, x @ weights[key].t(), atol=1e-4, rtol=1e-5)


def test_prefill_rows_take_the_amx_gemm_where_it_runs(gguf_model):
    """With amx, Q4_1 steps above GEMV_MAX_ROWS go through the AMX GEMM (where AMX works here):
    x to 16 bits, each term within 2^-14 of |x w| (the FMA GEMM without it: the fp32 matmul up
    to summation order); decode rows keep the GEMV; the Q8_0 head and the invariant mode never
    pack for it."""
    _, weights, blocks = gguf_model
    key = "model.layers.3.mlp.gate_proj.weight"
    dense = DenseLinear(weights[key])
    linear = GGUFLinear(blocks[key], dense, amx=True)
    assert (linear.amx is not None) == cpu_amx_gemm.available()
    x = torch.randn(100, weights[key].shape[1])
    got = linear(x)
    want = x.double() @ weights[key].double().t()
    if linear.amx is not None:
        assert torch.equal(got, cpu_amx_gemm.amx_gemm(x, linear.amx))
        bound = 2.0**-14 * (x.abs().double() @ weights[key].abs().double().t())
        assert ((got.double() - want).abs() <= bound + 1e-6).all()
    else:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(linear(x[:GEMV_MAX_ROWS]), GGUFLinear(blocks[key], dense)(x[:GEMV_MAX_ROWS]))
    embed = "model.embed_tokens.weight"
    head = GGUFLinear(blocks[embed], DenseLinear(weights[embed]), amx=True)
    assert head.amx is None  # Q8_0: the FMA GEMM
    assert GGUFLinear(blocks[key], dense, amx=True, invariant=True).amx is None
    assert GGUFLinear(blocks[key], dense).amx is None  # off unless asked


def test_concat_blocks_is_row_concatenation_of_one_kind(gguf_model):
    _, weights, blocks = gguf_model
    p = "model.layers.0.mlp."
    gate_up = concat_blocks([blocks[p + "gate_proj.weight"], blocks[p + "up_proj.weight"]])
    want = torch.cat([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]])
    assert torch.equal(cpu_quant_gemv.dequantize(gate_up.data, "q4_1"), want)
    assert concat_blocks([blocks[p + "gate_proj.weight"], None]) is None
    q8 = GGUFBlocks("q8_0", torch.zeros(1536, 576 // 32 * 34, dtype=torch.uint8))
    assert concat_blocks([blocks[p + "gate_proj.weight"], q8]) is None


def linear_kinds(model) -> set[str]:
    mods = [model.lm_head]
    for layer in model.layers:
        mods += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    return {type(m).__name__ for m in mods}


def test_load_model_keeps_blocks_only_for_fp32_dense_on_the_cpu(gguf_model, monkeypatch):
    config, weights, _ = gguf_model
    monkeypatch.setattr(loader, "read_gguf", lambda path: (config, weights))  # no re-reading
    model, _ = loader.load_model(MODEL, dtype="float32")
    assert linear_kinds(model) == {"GGUFLinear"}
    assert model.lm_head.kind == "q8_0"
    model, _ = loader.load_model(MODEL, dtype="float32", quantized_gemv=False)
    assert linear_kinds(model) == {"DenseLinear"}
    model, _ = loader.load_model(MODEL, dtype="float32", quantization="int8")
    assert "GGUFLinear" not in linear_kinds(model)
    model, _ = loader.load_model(MODEL, dtype="bfloat16")
    assert "GGUFLinear" not in linear_kinds(model)
    monkeypatch.setattr(cpu_quant_gemv, "available", lambda: False)  # no compiler here
    model, _ = loader.load_model(MODEL, dtype="float32")
    assert linear_kinds(model) == {"DenseLinear"}
