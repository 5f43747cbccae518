"""The C kernels' build: loading a kernel leaves the process's floating-point state alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh process: the smallest denormal is > 0 before and after each kernel library loads.
# A library linked with -ffast-math carries crtfastmath.o, which turns on flush-to-zero and
# denormals-are-zero at load, and then the comparison reads 0 > 0.
PROBE = """
import importlib
tiny = float.fromhex("0x1p-1074")
assert tiny > 0.0
module = importlib.import_module("kernels.{name}")
assert module.load() is not None, "the kernel did not build"
tiny = float.fromhex("0x1p-1074")
print(tiny > 0.0, float.fromhex("0x1p-1070") / 2 > 0.0)  # DAZ; FTZ
"""


@pytest.mark.parametrize("name", ["cpu_attention", "cpu_quant_gemv", "cpu_quant_gemm"])
def test_loading_a_kernel_keeps_denormals(name: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(name=name)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], (
        f"loading kernels.{name} changed the process's float state: {out.stdout}"
    )


def test_a_local_header_is_part_of_the_build_key(tmp_path) -> None:
    """A kernel built from a source and the header it includes is rebuilt when either changes."""
    from kernels import cbuild

    source, header = tmp_path / "k.c", tmp_path / "k.h"
    source.write_text('#include <stdint.h>\n#include "k.h"\nint f(void) { return K; }\n')
    header.write_text("#define K 1\n")
    assert cbuild.local_headers(source) == [header]
    first = cbuild.build_key(source, "cc", ("-O2",))
    header.write_text("#define K 2\n")
    assert cbuild.build_key(source, "cc", ("-O2",)) != first
    assert cbuild.build_key(source, "cc", ("-O3",)) != cbuild.build_key(source, "cc", ("-O2",))


def test_the_quantized_kernels_share_their_block_header() -> None:
    from kernels import cbuild, cpu_decode, cpu_fma_peak, cpu_quant_gemm, cpu_quant_gemv

    blocks, dot = "cpu_quant_blocks.h", "cpu_quant_dot.h"  # the GEMV's loops: dot
    for module in (cpu_quant_gemm, cpu_fma_peak):  # the FMA probe: the GEMV's ISA levels
        assert [h.name for h in cbuild.local_headers(module.SOURCE)] == [blocks]
    for module in (cpu_quant_gemv, cpu_decode):
        assert [h.name for h in cbuild.local_headers(module.SOURCE)] == [blocks, dot]
