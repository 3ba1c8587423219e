"""Build and load the C kernels in `models/kernels/csrc/` for CPU tensors.

The sources are compiled on first use, on the machine that runs them
(`-march=native`, with OpenMP where the compiler has it), into a per-user
cache keyed by the sources, the flags and the compiler, and loaded with
`ctypes`:

    $DISAGG_KERNEL_CACHE (default ~/.cache/disagg/kernels)/<name>-<key>.so

A library is built once per machine (the key includes the CPU's model and
feature flags, so a home directory shared by different machines is safe):
later processes load the cached file.
Builds write to a temporary name and rename it into place, so workers that
start together never load a half-written library. When no C compiler is
found or the build fails, `load` returns None (logged once) and callers use
their plain-torch implementation; `DISAGG_CPU_KERNELS=0` turns the C kernels
off the same way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
CACHE_ENV = "DISAGG_KERNEL_CACHE"
ENABLE_ENV = "DISAGG_CPU_KERNELS"
# No -ffast-math: it assumes no infinities, and the softmax starts from -inf.
# -fno-math-errno and associative math let the compiler vectorize the sums.
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-pthread",
)
# Tried first: the kernels' threads then come from the OpenMP runtime, which
# in a process that imported torch is torch's own (see csrc/parallel.h).
# A compiler without OpenMP builds them with per-call POSIX threads instead.
OPENMP_FLAGS = ("-fopenmp",)
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


@functools.cache
def enabled() -> bool:
    """False when `DISAGG_CPU_KERNELS=0` asks for the plain-torch paths.

    Read once per process: every kernel call of every step asks.
    `dispatch.reread_kernel_switches` reads it again (tests that change it).
    """
    return os.environ.get(ENABLE_ENV, "1") != "0"


def load(name: str) -> ctypes.CDLL | None:
    """The library built from `csrc/<name>.c`, or None where it cannot be had."""
    if not enabled():
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name)
        return _loaded[name]


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disagg" / "kernels"


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = SOURCE_DIR / f"{name}.c"
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler (cc, gcc or clang) found: CPU kernel %s runs in torch", name)
        return None
    headers = b"".join(path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes()
        + headers
        + " ".join((compiler, *FLAGS, *OPENMP_FLAGS)).encode()
        + _compiler_id(compiler)
        + _cpu_id()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        try:
            _compile(compiler, source, target)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("building CPU kernel %s failed, it runs in torch instead: %s", name, exc)
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("loading CPU kernel %s from %s failed: %s", name, target, exc)
        return None


def _compiler_id(compiler: str) -> bytes:
    try:
        return subprocess.run(
            [compiler, "--version"], capture_output=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _cpu_id() -> bytes:
    """The CPU's model and feature flags: `-march=native` code built on one
    machine must not be loaded on another from a shared home directory."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor().encode() + platform.machine().encode()
    wanted = ("model name", "flags", "Features", "CPU part")
    first = text.split("\n\n", 1)[0]
    return "\n".join(line for line in first.splitlines() if line.startswith(wanted)).encode()


def _compile(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (OPENMP_FLAGS, ()):
            result = subprocess.run(
                [compiler, *FLAGS, *extra, "-o", tmp, str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=_BUILD_TIMEOUT_S,
                check=False,
            )
            if result.returncode == 0:
                break
            logger.info("building %s with %s failed: %s", source.name, extra, result.stderr[-500:])
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip()[-2000:])
        os.replace(tmp, target)  # atomic: a concurrent build just wins or loses the race
        logger.info("built CPU kernel %s", target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class KernelFunction:
    """One C function of a library in `csrc/`, with its ctypes signature set,
    loaded on first use and kept (the library stays mapped for the life of
    the process). `get()` is None where the library cannot be had."""

    def __init__(self, library: str, name: str, argtypes: Sequence[Any]) -> None:
        self.library = library
        self.name = name
        self.argtypes = list(argtypes)
        self._fn: Any = None

    def get(self) -> Any | None:
        if not enabled():
            return None
        if self._fn is None:
            lib = load(self.library)
            if lib is None:
                return None
            fn = getattr(lib, self.name)
            fn.argtypes = self.argtypes
            fn.restype = ctypes.c_int
            self._fn = fn
        return self._fn

    def reset(self) -> None:
        """Forget the function, so the next `get()` loads the library again."""
        self._fn = None
