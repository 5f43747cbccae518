"""Building the C kernels: the CPU's feature flags, and compile-once-into-a-cache, then ctypes.

A library is built by the system C compiler into `cache_dir`, under a name keyed by its source,
flags, compiler and machine, written atomically (concurrent builders never see half a file), and
loaded with ctypes. Each kernel module chooses its own flags and instruction-set level.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (default: this CPU's).
    Linux lists only what the kernel has enabled (a feature whose register state it does not
    save is left out), so a listed flag can be used."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


BUILD_RECIPE = b"compile, then link without the fast-math startup file"  # in the cache key


def _compile(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into `target` atomically; -> None, or the compiler's complaint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    # Compile and link apart: linking with -ffast-math (or -Ofast) adds crtfastmath.o, whose
    # constructor sets flush-to-zero and denormals-are-zero for the whole process the moment
    # the library loads, so every float anywhere (msgspec's bounds, numpy, torch) would change.
    # Only the link-time part of the flags (OpenMP's runtime) goes to the link.
    link_flags = [f for f in flags if f.startswith("-fopenmp") and f != "-fopenmp-simd"]
    steps = (
        [compiler, *flags, "-fPIC", "-c", "-o", obj, str(source)],
        [compiler, *link_flags, "-shared", "-fPIC", "-o", tmp, obj, "-lm"],
    )
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return done.stderr.strip()[-500:] or f"exit status {done.returncode}"
        os.replace(tmp, target)  # concurrent builders each write their own file first
        return None
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def build_library(
    source: Path, compiler: str, flags: tuple[str, ...], cache_dir: Path, errors: list[str]
) -> ctypes.CDLL | None:
    """Build (or find in the cache) and load `source` with these flags; a failure is appended
    to `errors` and gives None."""
    parts = [source.read_bytes(), " ".join(flags).encode(), compiler.encode(), BUILD_RECIPE]
    key = hashlib.sha256(b"\0".join([*parts, platform.machine().encode()])).hexdigest()[:16]
    target = cache_dir / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            err = _compile(source, compiler, flags, target)
            if err is not None:
                errors.append(f"{' '.join(flags)}: {err}")
                return None
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:  # unwritable cache, odd compiler
        errors.append(f"{' '.join(flags)}: {err}")
        return None
