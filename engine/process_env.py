"""Environment variables of a process that runs an engine.

They are read once, at process start, so they go into the environment a
worker process is started with (Ray's `runtime_env`, the other ranks of a
tensor-parallel instance, a benchmark's child process).

On any device (`WORKER_ENV`):

- `RAY_worker_niceness=0`: Ray starts its worker processes at niceness 15,
  below everything else on the node (its own daemons, the router, an
  HTTP client), so that a burst of tasks cannot starve Ray's daemons. An
  engine worker is the node's main work: at niceness 15 every other
  process preempts its compute threads, which on a shared node stretches
  each step (a decode step's threads wait for each other at every parallel
  region). On the 2-core machine, an aggregated-only instance (2 threads)
  under 64 requests at once from a client on the same machine served 2205
  output tok/s at niceness 15 and 2562 at 0 (decode steps 16-19 against
  14 ms). 0 leaves the worker at the niceness of the raylet that starts
  it, never above it.

On CPU (`CPU_ENGINE_ENV`), for the C runtime:

- `GOMP_SPINCOUNT=5000`: an OpenMP thread that reaches the end of a
  parallel region spins about 90 microseconds for the next one before it
  sleeps (libgomp's default is 300,000 spins, a few milliseconds; passive
  waits sleep at once). A decode step runs a hundred or more regions a
  few tens of microseconds apart, and a sleeping thread pays a wake at
  each of them: SmolLM2 at 2 sequences on 2 threads runs 122 regions a
  step, and the gaps between them (a step's serial work: the calls
  between products, attention, norms) were 31-48 us, 88 us around
  attention and 140-390 us at the step's ends. Offline, a decode step of 8
  sequences took 58 ms with 3,000 spins, 49 with 10,000, 44-45 from 30,000
  up, 62 passive (an earlier build, whose gaps were longer); at 2
  sequences 5,000 spins gave 77.5-77.7 tok/s against 78.2-81.4 at 30,000.
  A spin too long costs where the engine shares its cores with the
  serving process and the client: a thread spinning for a partner that
  lost its core to them holds the core the partner, or they, could run
  on. Served on the 2-core machine with the client (`benchmarks.serve_cpu`,
  the anchor Llama, 64 requests at once), 30,000 spins gave 1766-1799
  output tok/s (the worker 3.2 CPU-s a run), 10,000 1812-1870, 5,000
  1977-2030 (2.8 CPU-s), 3,000 2032-2174 and passive waits 1901-2228
  (2.5 CPU-s); SmolLM2 (`benchmarks.serve_compare --servers ours-agg`,
  32 prompts) at rate inf 133-136 against 130 tok/s at 30,000, at 0.5 and
  1 request/s an ITL p50 of 30.9 / 32.6-33.2 ms against 29.4 / 31.9-32.1
  (vLLM's CPU build, which spins: about 40), the same TTFT. So the spin
  covers the gaps inside a step, and not much more. An idle instance
  spins only that long after its last step.
  Where other busy work shares the instance's cores (more runnable threads
  than cores), a spinning thread burns the time its preempted partner
  needs: with two `yes` loops on the 2 cores, SmolLM2 at 30,000 spins had an
  ITL p50 of 114-170 ms spinning against 84-88 passive. Such a host sets
  `OMP_WAIT_POLICY=PASSIVE` (libgomp then takes its spin count from the
  policy, as it does for any policy the environment names). At Ray's
  worker niceness of 15 (before `WORKER_ENV`), every spin lost, even on
  cores shared only with the router: passive waits were the default then.
- `MALLOC_ARENA_MAX=1`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`
  (glibc; other C libraries ignore them): a step frees its activations when
  it ends, and by default glibc returns them to the kernel (blocks above its
  mmap threshold are unmapped on free; freed memory at the top of a heap is
  trimmed; a thread's own arena drops a heap once it is all free), so the
  next step touches fresh pages that the kernel zero-fills one fault at a
  time. glibc raises its mmap threshold as it sees large blocks freed, so
  how often that happens depends on the step sizes and the glibc build
  (Debian's 2.36 stops re-faulting a repeated step after about five). One
  arena and thresholds raised to glibc's largest mmap threshold
  (32 MiB) and a 1 GiB trim keep freed blocks for reuse, as a caching
  allocator would: on the anchor Llama (hidden 256, fp32, one thread) a
  2,048-token prefill step took about 24,000 page faults and 150 ms of CPU,
  and about 100 ms without them. The process keeps its peak step's
  activations mapped.

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
