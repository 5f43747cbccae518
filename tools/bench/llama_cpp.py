"""llama.cpp as a peer: find its binaries, or fetch the llama-cpp-python sdist and build the
llama.cpp it vendors for this CPU; run llama-bench and llama-batched-bench and parse their output.

The build never uses -march=native: each ggml instruction-set option is set from /proc/cpuinfo,
and AMX only when a probe program has run AMX instructions here (a VM may list AMX flags that
trap). A build is cached under the data dir, keyed by its flags.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
SDIST_DIR = "llama_cpp_python-0.3.36"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server")
# ggml's x86 options and the /proc/cpuinfo flags each one needs
GGML_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
AMX_OPTIONS = (
    ("GGML_AMX_TILE", ("amx_tile",)),
    ("GGML_AMX_INT8", ("amx_tile", "amx_int8")),
    ("GGML_AMX_BF16", ("amx_tile", "amx_bf16")),
)
# Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
# ggml asks the same way. Exit 0: the tiles loaded and were used. The probe configures its tile
# as ggml's ggml_tile_config_init does (plain stores, then _tile_loadconfig), on purpose: GCC
# 12's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration, so the stores
# of rows and columns can be dropped as dead and tilezero traps on an unconfigured tile. Where
# that happens ggml's AMX kernels trap the same way (llama-bench: SIGILL at tilezero in
# tinygemm_kernel_amx, on an Intel Xeon whose AMX runs code that configures its tiles soundly),
# so a build with AMX would not run. Brigade's own AMX use does not depend on this probe.
AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;
    unsigned char cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


class Unavailable(RuntimeError):
    """llama.cpp cannot be had here; the message says why and what would fix it."""


@dataclass(frozen=True)
class Binaries:
    bench: Path
    batched_bench: Path
    server: Path | None
    build_flags: tuple[str, ...] = ()  # empty when found, not built


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def cmake_flags(flags: frozenset[str], *, amx_works: bool, machine: str = "x86_64") -> list[str]:
    """cmake options for a build on a CPU with these flags: every ggml instruction-set option set
    explicitly (with GGML_NATIVE=OFF ggml would otherwise turn on AVX2/FMA/F16C regardless)."""
    out = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF"]
    if machine not in ("x86_64", "AMD64", "i686"):
        return out  # ggml's defaults for other architectures need no x86 options
    options = GGML_OPTIONS + AMX_OPTIONS if amx_works else GGML_OPTIONS
    for name, needs in options:
        out.append(f"-D{name}={'ON' if set(needs) <= flags else 'OFF'}")
    if not amx_works:
        out += [f"-D{name}=OFF" for name, _ in AMX_OPTIONS]
    return out


def amx_works(flags: frozenset[str], work_dir: Path, compiler: str | None = None) -> bool:
    """Whether AMX instructions run here: compile and run the probe (only if cpuinfo lists AMX)."""
    if "amx_tile" not in flags:
        return False
    cc = compiler or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    work_dir.mkdir(parents=True, exist_ok=True)
    src, exe = work_dir / "amx_probe.c", work_dir / "amx_probe"
    src.write_text(AMX_PROBE)
    try:
        built = subprocess.run(
            [cc, "-O1", "-mamx-tile", "-o", str(exe), str(src)], capture_output=True, timeout=60
        )
        if built.returncode != 0:
            return False
        return subprocess.run([str(exe)], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def find(directory: Path) -> Binaries | None:
    """The binaries of a llama.cpp build: under build/bin, bin or the directory itself."""
    for where in (directory / "build" / "bin", directory / "bin", directory):
        bench, batched = where / "llama-bench", where / "llama-batched-bench"
        if bench.is_file() and batched.is_file():
            server = where / "llama-server"
            return Binaries(bench, batched, server if server.is_file() else None)
    return None


def cache_root(data_dir: Path) -> Path:
    return data_dir / "llama.cpp" / SDIST_DIR


def fetch_source(cache: Path) -> Path:
    """The sdist's vendor/llama.cpp, downloaded with pip and unpacked once."""
    src = cache / "src" / SDIST_DIR / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist_dir = cache / "sdist"
    tarballs = sorted(sdist_dir.glob(f"{SDIST_DIR}.tar.gz"))
    if not tarballs:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["-d", str(sdist_dir), SDIST]
        print(f"llama.cpp: downloading {SDIST} (the sdist, ~75 MB) ...", flush=True)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as err:
            raise Unavailable(f"pip download {SDIST} failed: {err}") from None
        tarballs = sorted(sdist_dir.glob(f"{SDIST_DIR}.tar.gz"))
        if done.returncode != 0 or not tarballs:
            tail = (done.stderr or done.stdout).strip()[-400:]
            raise Unavailable(f"pip download {SDIST} failed (exit {done.returncode}): {tail}")
    with tarfile.open(tarballs[0]) as tar:
        tar.extractall(cache / "src", filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise Unavailable(f"{tarballs[0].name} has no vendor/llama.cpp/CMakeLists.txt")
    return src


def planned_build(data_dir: Path) -> tuple[list[str], Path]:
    """The cmake options for this CPU and the build folder they are cached in."""
    cache = cache_root(data_dir)
    flags = read_cpu_flags()
    options = cmake_flags(flags, amx_works=amx_works(flags, cache), machine=platform.machine())
    key = hashlib.sha256(" ".join(options).encode()).hexdigest()[:12]
    return options, cache / f"build-{key}"


def cached(data_dir: Path) -> Binaries | None:
    """A build for this CPU made earlier under the data dir, if there is one."""
    options, build_dir = planned_build(data_dir)
    found = find(build_dir)
    return None if found is None else _with_flags(found, options)


def build(data_dir: Path, *, jobs: int = 2) -> Binaries:
    """Fetch and build llama-bench, llama-batched-bench and llama-server for this CPU, or find
    them already built with the same flags. Raises Unavailable with the reason."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise Unavailable(f"no {tool} on PATH: install cmake and a C++ compiler")
    options, build_dir = planned_build(data_dir)
    found = find(build_dir)
    if found is not None:
        return _with_flags(found, options)
    src = fetch_source(build_dir.parent)
    print(f"llama.cpp: building {', '.join(TARGETS)} with {' '.join(options)}", flush=True)
    steps = (
        ["cmake", "-S", str(src), "-B", str(build_dir), *options],
        ["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)],
    )
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        except (OSError, subprocess.SubprocessError) as err:
            raise Unavailable(f"{' '.join(cmd[:2])} failed: {err}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-600:]
            raise Unavailable(f"{' '.join(cmd[:2])} exited {done.returncode}: {tail}")
    found = find(build_dir)
    if found is None:
        raise Unavailable(f"the build finished but {build_dir}/bin lacks llama-bench")
    return _with_flags(found, options)


def _with_flags(found: Binaries, options: list[str]) -> Binaries:
    return Binaries(found.bench, found.batched_bench, found.server, tuple(options))


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench `-o json` -> {"pp512": avg tok/s, "tg128": avg tok/s}."""
    rows = json.loads(text[text.index("[") :])
    out = {}
    for row in rows:
        n_prompt, n_gen = int(row["n_prompt"]), int(row["n_gen"])
        if n_gen == 0:
            name = f"pp{n_prompt}"
        elif n_prompt == 0:
            name = f"tg{n_gen}"
        else:
            name = f"pp{n_prompt}+tg{n_gen}"
        out[name] = float(row["avg_ts"])
    return out


def parse_batched_bench(text: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown table -> {B: {"pp", "tg", "s_pp", "s_tg", ...}}.
    S_TG is B x TG / T_TG: decode tokens of every stream per second of decode steps."""
    columns = ("pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s")
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(columns):
            continue
        try:
            values = [float(c) for c in cells]
        except ValueError:
            continue  # the header and its rule
        row = dict(zip(columns, values, strict=True))
        out[int(row["b"])] = row
    return out


def run_llama_bench(
    exe: Path, gguf: Path, *, threads: int, repetitions: int, n_prompt: int = 512, n_gen: int = 128
) -> dict[str, float]:
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-r", str(repetitions), "-o", "json"]
    return parse_llama_bench(_run(cmd)[0])


def run_batched_bench(
    exe: Path, gguf: Path, *, threads: int, streams: tuple[int, ...], n_prompt: int, n_gen: int
) -> dict[int, dict[str, float]]:
    """Every stream its own prompt (not shared), decoded together; the context holds them all."""
    n_ctx = max(streams) * (n_prompt + n_gen)
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-c", str(n_ctx)]
    cmd += ["-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, streams))]
    found = parse_batched_bench("\n".join(_run(cmd)))  # its table is logged
    missing = [b for b in streams if b not in found]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for {missing} streams")
    return found


def _run(cmd: list[str]) -> tuple[str, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode == -signal.SIGILL:
        raise RuntimeError(
            f"{Path(cmd[0]).name} died of SIGILL: it was built with an instruction this CPU "
            "lacks or traps (AMX on some VMs); rebuild it with fewer GGML_* options"
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"{Path(cmd[0]).name} exited {done.returncode}: {done.stderr.strip()[-400:]}"
        )
    return done.stdout, done.stderr
