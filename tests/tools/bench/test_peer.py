"""brigade bench peer without building or running anything: the cmake flags chosen from a given
/proc/cpuinfo, llama-bench's `-o json` and llama-batched-bench's table parsed as those programs
print them (llama-cpp-python 0.3.36's llama.cpp), the ratio table and the skip message."""

from __future__ import annotations

import pytest

from tools.bench import llama_cpp, peer

# An Intel Sapphire Rapids VM that lists AMX, and a Haswell desktop (AVX2, no AVX-512)
SAPPHIRE_RAPIDS = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\n"
    "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush "
    "mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology "
    "cpuid pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c "
    "rdrand hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid "
    "rtm avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw "
    "avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 avx512vbmi umip pku ospke "
    "waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid "
    "movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 "
    "arch_capabilities\n\nprocessor\t: 1\nflags\t\t: fpu\n"
)
HASWELL = (
    "processor\t: 0\nmodel name\t: Intel(R) Core(TM) i7-4770 CPU @ 3.40GHz\nflags\t\t: fpu vme "
    "sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm abm "
    "bmi1 avx2 smep bmi2 erms invpcid\n"
)


def options(cmake: list[str]) -> dict[str, str]:
    return dict(flag.removeprefix("-D").split("=", 1) for flag in cmake)


def test_flags_follow_the_cpu_and_leave_amx_off_unless_it_works():
    flags = llama_cpp.cpu_flags(SAPPHIRE_RAPIDS)
    assert "amx_tile" in flags and "fpu" in flags and len(flags) > 100  # the first processor's
    got = options(llama_cpp.cmake_flags(flags, amx_works=False))
    assert got["GGML_NATIVE"] == "OFF" and got["LLAMA_CURL"] == "OFF"
    on = {k for k, v in got.items() if v == "ON"}
    assert on == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C",
        "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
    }  # fmt: skip
    assert got["GGML_AMX_TILE"] == got["GGML_AMX_INT8"] == got["GGML_AMX_BF16"] == "OFF"
    with_amx = options(llama_cpp.cmake_flags(flags, amx_works=True))
    assert with_amx["GGML_AMX_TILE"] == with_amx["GGML_AMX_INT8"] == "ON"
    assert with_amx["GGML_AMX_BF16"] == "ON"


def test_an_avx2_cpu_gets_no_avx512_and_other_machines_no_x86_options():
    got = options(llama_cpp.cmake_flags(llama_cpp.cpu_flags(HASWELL), amx_works=False))
    assert got["GGML_AVX2"] == got["GGML_FMA"] == got["GGML_F16C"] == got["GGML_BMI2"] == "ON"
    assert got["GGML_AVX512"] == got["GGML_AVX512_BF16"] == got["GGML_AVX_VNNI"] == "OFF"
    # ggml's AVX512 option turns on F, CD, VL, DQ and BW together: all five are needed
    partial = llama_cpp.cpu_flags(HASWELL) | {"avx512f", "avx512_bf16"}
    assert options(llama_cpp.cmake_flags(partial, amx_works=False))["GGML_AVX512"] == "OFF"
    arm = llama_cpp.cmake_flags(frozenset({"neon", "asimd"}), amx_works=False, machine="aarch64")
    assert arm == ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF"]


def test_amx_is_not_probed_where_cpuinfo_lists_none(tmp_path):
    assert not llama_cpp.amx_works(llama_cpp.cpu_flags(HASWELL), tmp_path, compiler="false")
    assert not list(tmp_path.iterdir())  # nothing compiled
    # listed but the probe cannot be built or run: not used
    assert not llama_cpp.amx_works(llama_cpp.cpu_flags(SAPPHIRE_RAPIDS), tmp_path, "false")


# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 512 -n 128 -o json` (stdout)
LLAMA_BENCH_JSON = """\
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-01T10:19:17Z",
    "avg_ns": 1703911000,
    "stddev_ns": 0,
    "avg_ts": 300.484,
    "stddev_ts": 2.11,
    "samples_ns": [ 1695123000, 1712699000 ],
    "samples_ts": [ 302.05, 298.95 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-12-01T10:19:24Z",
    "avg_ns": 977099000,
    "stddev_ns": 0,
    "avg_ts": 131.0,
    "stddev_ts": 3.2,
    "samples_ns": [ 960000000, 994198000 ],
    "samples_ts": [ 133.3, 128.7 ]
  }
]
"""

# `llama-batched-bench -m ... -t 2 -c 8192 -npp 128 -ntg 128 -npl 1,8,32`: its log (stdout)
BATCHED_BENCH_LOG = """
llama_batched_bench: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, \
is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.425 |   301.18 |    1.488 |    86.02 |    1.913 |   133.82 |
|   128 |    128 |    8 |   2048 |    3.601 |   284.36 |    4.808 |   212.98 |    8.409 |   243.55 |
|   128 |    128 |   32 |   8192 |   16.012 |   255.81 |   16.000 |   256.00 |   32.012 |   255.91 |

"""


def test_parses_llama_bench_json():
    assert llama_cpp.parse_llama_bench(LLAMA_BENCH_JSON) == {"pp512": 300.484, "tg128": 131.0}


def test_parses_the_batched_bench_table():
    rows = llama_cpp.parse_batched_bench(BATCHED_BENCH_LOG)
    assert sorted(rows) == [1, 8, 32]
    assert rows[8]["s_tg"] == 212.98 and rows[32]["t_tg"] == 16.0 and rows[1]["pp"] == 128
    assert rows[32]["s_tg"] == pytest.approx(32 * 128 / rows[32]["t_tg"])  # S_TG's definition


BRIGADE = {"pp512": 2433.0, "tg128": 100.0, "decode_1": 86.0, "decode_8": 287.0, "decode_32": 800}
LLAMA = {"pp512": 370.0, "tg128": 120.0, "decode_1": 86.0, "decode_8": 213.0, "decode_32": 256.0}


def test_ratio_rows_hold_both_figures_and_the_verdicts():
    rows = {r["metric"]: r for r in peer.ratio_rows(BRIGADE, LLAMA)}
    assert list(rows) == ["pp512", "tg128", "decode_1", "decode_8", "decode_32"]
    assert rows["pp512"]["ratio"] == 6.58 and rows["pp512"]["meets_target"] is True
    assert rows["tg128"]["ratio"] == 0.83 and rows["tg128"]["meets_target"] is False
    assert rows["decode_1"]["target"] is None and rows["decode_1"]["meets_target"] is None
    assert rows["decode_8"]["ratio"] == 1.35 and rows["decode_8"]["meets_target"] is False
    assert rows["decode_32"]["ratio"] == 3.12 and rows["decode_32"]["meets_target"] is True
    quick = peer.ratio_rows({k: v for k, v in BRIGADE.items() if k != "decode_32"}, LLAMA)
    assert [r["metric"] for r in quick] == ["pp512", "tg128", "decode_1", "decode_8"]


def result(llama, skipped=None) -> dict:
    return {
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "threads": 2,
        "quick": False,
        "load_average_at_start": [0.1, 0.2, 0.3],
        "llama_cpp_skipped": skipped,
        "llama_cpp_build_flags": ["-DGGML_NATIVE=OFF"],
        "rows": peer.ratio_rows(BRIGADE, llama),
    }


def test_the_table_prints_ratios_targets_and_verdicts():
    table = peer.markdown(result(LLAMA))
    assert "| metric | llama.cpp | Brigade | Brigade / llama.cpp | target | |" in table
    assert "| prefill of 512 tokens, tok/s | 370.0 | 2,433.0 | 6.58x | >= 5x | pass |" in table
    tg = "| single-stream decode of 128 tokens, tok/s | 120.0 | 100.0 | 0.83x | >= 1.3x | FAIL |"
    one = "| decode, 1 stream after a 128-token prompt, tok/s | 86.0 | 86.0 | 1.00x | — |  |"
    assert tg in table and one in table
    assert "built with `-DGGML_NATIVE=OFF`" in table
    assert "2 threads; load average at start [0.1, 0.2, 0.3]" in table
    assert "busy" not in table
    busy = peer.markdown({**result(LLAMA), "threads": 1, "load_average_at_start": [4.8, 4, 4]})
    assert "1 thread; load average" in busy
    assert "The machine was busy (load average above the threads)" in busy


def test_without_llama_cpp_the_table_says_why_and_shows_brigade_alone(tmp_path):
    with pytest.raises(llama_cpp.Unavailable) as err:
        peer.find_llama_cpp(tmp_path / "nowhere", tmp_path, skip_build=False)
    assert f"no llama-bench and llama-batched-bench under {tmp_path / 'nowhere'}" in str(err.value)
    with pytest.raises(llama_cpp.Unavailable, match="--skip-build and no earlier build under"):
        peer.find_llama_cpp(None, tmp_path, skip_build=True)
    table = peer.markdown(result(None, skipped=str(err.value)))
    assert "| prefill of 512 tokens, tok/s | — | 2,433.0 | — | >= 5x |  |" in table
    assert "llama.cpp is not available, so only Brigade is measured: no llama-bench" in table


def test_finds_a_build_under_build_bin(tmp_path):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-bench", "llama-batched-bench"):
        (bin_dir / name).write_text("")
    found = peer.find_llama_cpp(tmp_path, tmp_path, skip_build=True)
    assert found.bench == bin_dir / "llama-bench" and found.server is None


def empty_report(**extra) -> dict:
    """A bench peer report with no rows, only the lines in `extra` (its floor or ceiling)."""
    return {"threads": 2, "load_average_at_start": [0.1, 0.1, 0.1], "quick": True,
            "gguf": "m.gguf", "rows": [], "llama_cpp_skipped": None,
            "llama_cpp_build_flags": [], **extra}  # fmt: skip


def test_the_single_stream_floor_is_the_weights_over_the_read_bandwidth():
    from engine.weights import read_gguf_header, resolve_model

    gguf = resolve_model("smollm2-135m")
    weights = peer.weight_bytes(gguf)
    header = read_gguf_header(gguf)
    assert 90 * 2**20 < weights < gguf.stat().st_size  # the tensor data, not the header
    assert weights == gguf.stat().st_size - header.tensors["token_embd.weight"].offset
    bandwidth = peer.read_bandwidth(threads=1, repetitions=2, nbytes=64 << 20)
    assert 1e8 < bandwidth < 1e12  # bytes a second: 0.1 to 1000 GB/s
    row = peer.floor_row(weights, bandwidth=20e9, llama={"tg128": 200.0})
    assert row["ceiling_tok_s"] == round(20e9 / weights, 1)
    assert row["target_tok_s"] == 260.0
    assert row["target_above_ceiling"] == (260.0 > 20e9 / weights)
    assert peer.floor_row(weights, 20e9, None)["target_above_ceiling"] is None
    text = peer.markdown(empty_report(floor=row))
    assert f"than {row['ceiling_tok_s']:,.1f} tok/s" in text and "1.3x llama.cpp" in text


def test_the_prefill_ceiling_is_the_projections_flops_over_the_fma_peak():
    from engine.config import ModelConfig
    from engine.weights import read_gguf_header, resolve_model

    header = read_gguf_header(resolve_model("smollm2-135m"))
    config = ModelConfig.from_gguf_metadata(header.metadata, has_output_weight=False)
    from kernels.cpu_fma_peak import fma_peak

    # the units of two cores (the machine has at least two): up to three tries, since another
    # process that takes a core for a moment (the suite's own servers) leaves one core's units
    for _ in range(3):
        one, two = fma_peak(threads=1, seconds=0.05), fma_peak(threads=2, seconds=0.05)
        assert 1e9 < one < 1e12  # flops a second: 1 to 1,000 GFLOP/s a core
        if two > 1.2 * one:
            break
    assert two > 1.2 * one
    row = peer.prefill_ceiling_row(config, flops_s=100e9, llama={"pp512": 400.0})
    # SmolLM2-135M: 30 layers of 576 x (576 + 2 * 192) + 576 x 576 + 3 x 576 x 1536 weights
    per_token = 2 * 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert row["gflop_per_token"] == round(per_token / 1e9, 4)
    assert row["ceiling_tok_s"] == round(100e9 / per_token, 1)
    assert row["target_tok_s"] == 2000.0 and row["target_above_ceiling"] is True
    assert peer.prefill_ceiling_row(config, 100e9, None)["target_above_ceiling"] is None
    text = peer.markdown(empty_report(prefill_ceiling=row))
    assert f"no fp32 engine prefills faster than {row['ceiling_tok_s']:,.1f} tok/s" in text
    assert "2,000.0 tok/s: above that ceiling" in text
    assert "AMX" not in text  # an engine that does not use the tiles: no second ceiling
    # where prefill runs on AMX tiles: their peak over three bf16 products a term
    amx = peer.prefill_ceiling_row(config, 100e9, {"pp512": 400.0}, amx_flops_s=4000e9)
    assert amx["amx_ceiling_tok_s"] == round(4000e9 / 3 / per_token, 1)
    assert amx["target_above_amx_ceiling"] is False  # 2,000 tok/s under 4,000e9 / 3 / 0.212e9
    text = peer.markdown(empty_report(prefill_ceiling=amx))
    assert f"so that path prefills at most {amx['amx_ceiling_tok_s']:,.1f} tok/s" in text
    assert "the target below it" in text


def test_the_tiles_peak_is_measured_where_amx_runs():
    from kernels import cpu_amx_gemm

    peak = cpu_amx_gemm.tile_peak(threads=1, seconds=0.05)
    if not cpu_amx_gemm.available():
        assert peak is None
    else:  # bf16 tile flops: more than the fp32 FMA units' 1-1,000 GFLOP/s a core
        assert 50e9 < peak < 1e14


def test_rounds_give_median_figures_and_the_median_of_each_rounds_ratio():
    """Alternated rounds: a round where the machine slowed for one side's turn (round 2: llama.cpp
    slow, round 3: Brigade slow) moves its own ratio, not the table's."""
    slow_peer = {k: v / 2 for k, v in LLAMA.items()}
    slow_mine = {k: v / 2 for k, v in BRIGADE.items()}
    rows = {r["metric"]: r for r in peer.ratio_rows([BRIGADE, BRIGADE, slow_mine],
                                                    [LLAMA, slow_peer, LLAMA])}  # fmt: skip
    tg = rows["tg128"]
    assert tg["ratios"] == [0.83, 1.67, 0.42] and tg["ratio"] == 0.83
    assert (tg["brigade"], tg["llama_cpp"]) == (100.0, 120.0)
    assert tg["meets_target"] is False
    table = peer.markdown({**result(LLAMA), "rounds": 3,
                           "rows": peer.ratio_rows([BRIGADE] * 3, [LLAMA] * 3)})  # fmt: skip
    assert "3 rounds, llama.cpp's and Brigade's alternated" in table
    assert "| target | | each round |" in table
    assert "| 120.0 | 100.0 | 0.83x | >= 1.3x | FAIL | 0.83, 0.83, 0.83 |" in table
    alone = peer.ratio_rows([BRIGADE, BRIGADE], None)
    assert all(r["ratio"] is None and r["ratios"] is None for r in alone)
