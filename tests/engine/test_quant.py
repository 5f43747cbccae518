"""Weight-only linears: int4 recovers a Q4_1-style grid exactly, int8 within its step size."""

import pytest
import torch

from engine.quant import (
    DecodeLinear,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    TwoRowLinear,
    make_linear,
)


def test_int4_is_exact_on_a_4bit_asymmetric_grid():
    g = torch.Generator().manual_seed(0)
    out_f, in_f = 64, 96
    codes = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its full range, as Q4_1 does
    scale = torch.rand(out_f, in_f // 32, 1, generator=g) * 0.01 + 0.001
    low = torch.randn(out_f, in_f // 32, 1, generator=g) * 0.05
    w = (codes * scale + low).reshape(out_f, in_f)  # [out, in]
    x = torch.randn(5, in_f, generator=g)
    lin = Int4Linear(w, torch.float32)
    torch.testing.assert_close(lin.forward(x), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_int8_error_is_bounded_by_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g)
    lin = Int8Linear(w, torch.float32)
    deq = lin.weight.float() * lin.scales[:, None]
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(lin.forward(x), x @ deq.t(), atol=1e-4, rtol=1e-4)


def test_make_linear_choices():
    w = torch.randn(8, 40)
    assert type(make_linear(w, quantization=None, dtype=torch.bfloat16)) is DenseLinear
    assert type(make_linear(w, quantization="int8", dtype=torch.bfloat16)) is Int8Linear
    # 40 inputs do not split into groups of 32, 8 outputs are not a multiple of 16: int8
    assert type(make_linear(w, quantization="int4", dtype=torch.bfloat16)) is Int8Linear
    assert (
        type(make_linear(torch.randn(8, 64), quantization="int4", dtype=torch.float32))
        is Int8Linear
    )
    assert (
        type(make_linear(torch.randn(16, 64), quantization="int4", dtype=torch.float32))
        is Int4Linear
    )
    with pytest.raises(ValueError, match="allowed: None, int8, int4"):
        make_linear(w, quantization="fp4", dtype=torch.float32)


def test_decode_variant_uses_the_quantized_kernel_up_to_8_rows():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=g)
    lin = make_linear(w, quantization="int4-decode", dtype=torch.float32)
    assert type(lin) is DecodeLinear and type(lin.small) is Int4Linear
    x = torch.randn(9, 64, generator=g)
    assert torch.equal(lin.forward(x[:8]), lin.small.forward(x[:8]))
    assert torch.equal(lin.forward(x), x @ w.t())  # 9 rows: the dense weights
    assert not torch.equal(lin.forward(x[:8]), x[:8] @ w.t())


def test_batch_invariant_linear_computes_one_row_as_two():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(5, 64, generator=g).bfloat16()
    for quantization, kind in ((None, DenseLinear), ("int4", Int4Linear), ("int8", Int8Linear)):
        lin = make_linear(w, quantization=quantization, dtype=torch.bfloat16, batch_invariant=True)
        assert type(lin) is TwoRowLinear and type(lin.inner) is kind
        assert torch.equal(lin.forward(x[2:3]), lin.inner.forward(x[2:3].repeat(2, 1))[:1])
        assert torch.equal(lin.forward(x), lin.inner.forward(x))
    with pytest.raises(ValueError, match="'int4-decode'; allowed with batch_invariant: None, int8"):
        make_linear(w, quantization="int4-decode", dtype=torch.bfloat16, batch_invariant=True)


# torch picks the int4/int8 kernels' vector code by the CPU itself (ATen's per-capability
# dispatch: AVX512, AVX2 or the plain DEFAULT build); ATEN_CPU_CAPABILITY caps it below what the
# CPU has. Each capability must give the dense reference's answer.
_CAPABILITY_CHECK = """
import torch
from engine.quant import Int4Linear, Int8Linear
print(torch.backends.cpu.get_cpu_capability())
g = torch.Generator().manual_seed(4)
out_f, in_f = 48, 128
codes = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g).float()
codes[..., 0], codes[..., 1] = 0, 15
scale = torch.rand(out_f, in_f // 32, 1, generator=g) * 0.01 + 0.001
w = (codes * scale + torch.randn(out_f, in_f // 32, 1, generator=g) * 0.05).reshape(out_f, in_f)
for rows in (1, 5, 33):  # the GEMV, a small and a larger GEMM
    x = torch.randn(rows, in_f, generator=g)
    torch.testing.assert_close(Int4Linear(w, torch.float32)(x), x @ w.t(), atol=1e-5, rtol=1e-5)
    lin8 = Int8Linear(w, torch.bfloat16)
    deq = (lin8.weight.float() * lin8.scales.float()[:, None]).bfloat16()
    xb = x.bfloat16()
    torch.testing.assert_close(lin8(xb), xb @ deq.t(), atol=2e-2, rtol=1.6e-2)
    int4b = Int4Linear(w, torch.bfloat16)(xb)
    torch.testing.assert_close(int4b, (xb.float() @ w.t()).bfloat16(), atol=3e-2, rtol=1.6e-2)
print("ok")
"""


@pytest.mark.parametrize("capability", ["default", "avx2", None])  # None: what torch picks
def test_quantized_linears_match_the_reference_at_each_cpu_capability(capability):
    import os
    import subprocess
    import sys
    from pathlib import Path

    native = torch.backends.cpu.get_cpu_capability()
    if capability == "avx2" and native not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU's capability is {native}, below AVX2")
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _CAPABILITY_CHECK],
        capture_output=True, text=True, timeout=300, env=env, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    reported, result = done.stdout.split()
    assert reported == (capability or native).upper() and result == "ok"
