"""Building the C kernels: the CPU's feature flags, and compile-once-into-a-cache, then ctypes.

A library is built by the system C compiler into `cache_dir`, under a name keyed by its source,
flags, compiler and machine, written atomically (concurrent builders never see half a file), and
loaded with ctypes. `CKernel` is one kernel's whole life (options, the instruction-set level
chosen from the CPU at run time, load once, fall back with a reason); each kernel module names
its source, levels and flags.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

log = logging.getLogger("brigade.kernels")


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


def local_headers(source: Path) -> list[Path]:
    """The headers `source` includes by a quoted name, found beside it (one level deep)."""
    names = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', source.read_bytes(), re.MULTILINE)
    return [source.parent / n.decode() for n in names]


def build_key(source: Path, compiler: str, flags: tuple[str, ...]) -> str:
    """What a built library depends on: its source and local headers, flags, compiler, recipe."""
    parts = [source.read_bytes(), *(h.read_bytes() for h in local_headers(source))]
    parts += [" ".join(flags).encode(), compiler.encode(), BUILD_RECIPE]
    return hashlib.sha256(b"\0".join([*parts, platform.machine().encode()])).hexdigest()[:16]


def build_library(
    source: Path, compiler: str, flags: tuple[str, ...], cache_dir: Path, errors: list[str]
) -> ctypes.CDLL | None:
    """Build (or find in the cache) and load `source` with these flags; a failure is appended
    to `errors` and gives None."""
    target = cache_dir / f"{source.stem}-{build_key(source, compiler, flags)}.so"
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


@dataclass(frozen=True)
class IsaLevels:
    """A kernel's instruction-set levels, best first: the x86-64 compiler flags of each, the
    /proc/cpuinfo flags it needs, and the code its library's kernel_isa() reports. Off x86-64
    every level is the compiler's default target."""

    compiler_flags: dict[str, tuple[str, ...]]
    needs: dict[str, frozenset[str]]
    codes: dict[str, int]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.compiler_flags)

    def best(self, flags: frozenset[str], x86: bool = True) -> str:
        """The best level whose features are all in `flags`; the last one off x86-64."""
        if not x86:
            return self.names[-1]
        return next(level for level in self.names if self.needs[level] <= flags)

    def flags_of(self, level: str) -> tuple[str, ...]:
        return self.compiler_flags[level] if is_x86() else ()

    def lacking(self, level: str) -> frozenset[str]:
        """What this CPU lacks of a level's features (nothing off x86-64)."""
        return self.needs[level] - cpu_flags() if is_x86() else frozenset()

    def of(self, lib: ctypes.CDLL) -> str:
        """The level a loaded library was compiled for, as it reports itself."""
        code = lib.kernel_isa()
        return next(level for level, c in self.codes.items() if c == code)


@dataclass(frozen=True, kw_only=True)
class KernelOptions:
    """How a kernel's `load()` gets it; the engine stage fills these from schemas.settings
    (kernels never read the environment). A kernel module subclasses it to name its levels."""

    LEVELS: ClassVar[tuple[str, ...]] = ()

    enabled: bool = True  # False: load() gives None (the caller's torch path)
    compiler: str | None = None  # None: cc, else gcc
    cache_root: Path | None = None  # None: ~/.cache
    isa: str | None = None  # one of LEVELS; None: the best this CPU has

    def __post_init__(self) -> None:
        if self.isa is not None and self.isa not in self.LEVELS:
            raise ValueError(f"isa {self.isa!r} is not one of {', '.join(self.LEVELS)}")


class CKernel:
    """One C kernel: its options, the level it builds, and its library, built on first use.
    `load()` never raises: without a compiler, at a forced level this CPU lacks, or when no
    flag set builds, it logs why and gives None, and the caller takes its torch path."""

    def __init__(
        self,
        *,
        title: str,  # "the CPU paged-attention kernel", for the log
        source: Path,
        levels: IsaLevels,
        flag_sets: tuple[tuple[str, ...], ...],  # tried in order; later ones ask less of cc
        bind: Callable[[ctypes.CDLL], None],  # sets the entry points' argtypes and restypes
        fallback: str,  # what happens without it: "CPU attention uses the torch path"
        options: KernelOptions,
    ) -> None:
        self.title, self.source, self.levels = title, source, levels
        self.flag_sets, self.bind, self.fallback = flag_sets, bind, fallback
        self.options = options
        self._lib: ctypes.CDLL | None = None
        self._loaded = False

    def configure(self, options: KernelOptions) -> None:
        """Use `options` from now on, forgetting the library loaded under the previous ones."""
        if options != self.options:
            self.options, self._lib, self._loaded = options, None, False

    def cache_dir(self) -> Path:
        return (self.options.cache_root or Path.home() / ".cache") / "brigade" / "kernels"

    def compiler(self) -> str | None:
        return self.options.compiler or shutil.which("cc") or shutil.which("gcc")

    def chosen_isa(self) -> str:
        """The level `load()` builds: the forced one, else the best this CPU has."""
        return self.options.isa or self.levels.best(cpu_flags(), is_x86())

    def load(self) -> ctypes.CDLL | None:
        if not self._loaded:
            self._lib, self._loaded = self._build(), True
        return self._lib

    def _build(self) -> ctypes.CDLL | None:
        if not self.options.enabled:
            return None
        cc = self.compiler()
        if cc is None:
            log.warning("no C compiler (cc/gcc, or $CC): %s", self.fallback)
            return None
        level = self.chosen_isa()
        lacking = self.levels.lacking(level)
        if lacking:  # only a forced level can get here
            log.warning(
                "%s's isa %r needs CPU features this CPU lacks (%s); choose a lower one (%s): %s",
                self.title,
                level,
                ", ".join(sorted(lacking)),
                ", ".join(self.levels.names),
                self.fallback,
            )
            return None
        isa_flags = self.levels.flags_of(level)
        errors: list[str] = []
        for flags in self.flag_sets:
            lib = build_library(self.source, cc, (*flags, *isa_flags), self.cache_dir(), errors)
            if lib is None:
                continue
            self.bind(lib)
            lib.kernel_isa.argtypes, lib.kernel_isa.restype = [], ctypes.c_int
            built = self.levels.of(lib)
            if built != level:
                errors.append(f"{' '.join(flags)}: built for {built}, not {level}")
                continue
            log.info("%s: %s (%s)", self.title, level, " ".join(isa_flags))
            return lib
        log.warning("could not build %s; %s:\n%s", self.title, self.fallback, "\n".join(errors))
        return None
