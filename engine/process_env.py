"""Environment variables of a process that runs an engine.

They are read once, at process start, so they go into the environment a
worker process is started with (Ray's `runtime_env`, the other ranks of a
tensor-parallel instance, a benchmark's child process).

On any device (`WORKER_ENV`):

- `RAY_worker_niceness=0`: Ray starts its worker processes at niceness 15, so
  every other process on the node (the router, an HTTP client) would preempt
  an engine's compute threads and stretch each step; 0 leaves the worker at
  the niceness of the raylet that starts it, never above it.

On CPU (`CPU_ENGINE_ENV`), for the C runtime:

- `GOMP_SPINCOUNT=5000`: an OpenMP thread that reaches the end of a parallel
  region spins about 90 microseconds for the next one before it sleeps. That
  covers the gaps between the hundred-odd regions of a decode step, and not
  much more: a longer spin holds a core that the serving process and the
  client on the same cores need. A host where other busy work shares the
  instance's cores sets `OMP_WAIT_POLICY=PASSIVE`.
- `MALLOC_ARENA_MAX=1`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`
  (glibc; other C libraries ignore them): one arena and thresholds raised to
  glibc's largest mmap threshold (32 MiB) and a 1 GiB trim keep a step's
  freed activations mapped for the next step, as a caching allocator would,
  instead of returning them to the kernel and zero-filling fresh pages one
  fault at a time. The process keeps its peak step's activations mapped.

`benchmarks/README.md` ("Worker process environment") has the measurements
behind each value and the commands that rerun them.

A value already set in the environment of the process that starts the
worker is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

WORKER_ENV: dict[str, str] = {"RAY_worker_niceness": "0"}
CPU_ENGINE_ENV: dict[str, str] = {
    "GOMP_SPINCOUNT": "5000",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}


def cpu_engine_env() -> dict[str, str]:
    """`CPU_ENGINE_ENV`, each value overridden by this process's environment;
    an `OMP_WAIT_POLICY` set there is passed on and replaces the default spin
    count (a spin count set there too is kept)."""
    env = _overridden(CPU_ENGINE_ENV)
    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
        if "GOMP_SPINCOUNT" not in os.environ:
            del env["GOMP_SPINCOUNT"]
    return env


def worker_env(device: str) -> dict[str, str]:
    """What an engine worker process on `device` ("cpu", "cuda", ...) starts
    with: `WORKER_ENV`, and `CPU_ENGINE_ENV` on CPU, each value overridden by
    this process's environment."""
    return {**_overridden(WORKER_ENV), **(cpu_engine_env() if device == "cpu" else {})}


def inherited_worker_env() -> dict[str, str]:
    """The `worker_env` names set in this (worker) process's environment,
    with their values: what the other ranks of its instance start with."""
    names = (*WORKER_ENV, *CPU_ENGINE_ENV, "OMP_WAIT_POLICY")
    return {name: os.environ[name] for name in names if name in os.environ}


def _overridden(defaults: dict[str, str]) -> dict[str, str]:
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


def run_in_cpu_engine_env(module: str, argv: Sequence[str] | None) -> None:
    """Re-execute `python -m module argv` in the environment served CPU
    workers start with, unless this process already runs in it (the C
    runtime reads these variables at start); for benchmarks that time the
    engine in-process. `argv` None means this process's own arguments."""
    env = {**os.environ, **cpu_engine_env()}
    if any(os.environ.get(name) != value for name, value in env.items()):
        arguments = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", module, *arguments], env)
