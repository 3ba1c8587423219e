"""The environment an engine worker process starts with: the niceness of
Ray's node on any device, the CPU runtime settings on CPU, kept overrides,
and a step's freed activations reused instead of faulted in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from engine.process_env import CPU_ENGINE_ENV, WORKER_ENV, cpu_engine_env, worker_env

# Eight MLP-shaped "steps" (2,048 tokens, hidden 256, fp32) on a thread other
# than the main one, as the engine's compute thread runs them; prints the
# page faults each step took.
STEPS = """
import json, resource, threading, torch
torch.set_num_threads(1)
x = torch.randn(2048, 256); w1 = torch.randn(1536, 256); w2 = torch.randn(256, 768)
faults = []
def run():
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        h = x
        for _ in range(4):
            gate_up = h @ w1.T
            h = h + (torch.nn.functional.silu(gate_up[:, :768]) * gate_up[:, 768:]) @ w2.T
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps(faults))
"""


def _step_faults(env: dict[str, str]) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True
    )
    return list(json.loads(out.stdout))


def test_a_value_set_in_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    env = cpu_engine_env()
    assert env["GOMP_SPINCOUNT"] == "1000"
    assert env["MALLOC_ARENA_MAX"] == CPU_ENGINE_ENV["MALLOC_ARENA_MAX"]
    assert env.keys() == CPU_ENGINE_ENV.keys()


def test_a_wait_policy_in_the_environment_replaces_the_default_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # libgomp lets GOMP_SPINCOUNT win over the policy: the default spin
    # would turn a host's PASSIVE into a spin.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = worker_env("cpu")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    env = worker_env("cpu")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["GOMP_SPINCOUNT"] == "500"
    assert "OMP_WAIT_POLICY" not in worker_env("cuda")


def test_every_worker_runs_at_the_nodes_niceness_and_cpu_ones_get_the_runtime_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (*WORKER_ENV, *CPU_ENGINE_ENV, "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    assert worker_env("cuda") == {"RAY_worker_niceness": "0"}
    assert worker_env("cpu") == {"RAY_worker_niceness": "0", **CPU_ENGINE_ENV}
    monkeypatch.setenv("RAY_worker_niceness", "5")
    assert worker_env("cuda") == {"RAY_worker_niceness": "5"}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc settings are glibc's")
def test_steps_reuse_freed_memory_instead_of_faulting_it_in() -> None:
    plain = {k: v for k, v in os.environ.items() if k not in CPU_ENGINE_ENV}
    # glibc's mmap threshold starts at 128 KiB and adapts to freed chunks on
    # its own schedule, which differs between glibc builds; pinned at that
    # start, it hands every step's activations back and the next step faults
    # them in again. That shows the measurement sees re-faulting when it
    # happens, whatever the installed glibc's heuristics do.
    eager = _step_faults(
        {
            **plain,
            "MALLOC_MMAP_THRESHOLD_": str(128 << 10),
            "MALLOC_TRIM_THRESHOLD_": str(128 << 10),
        }
    )
    engine = _step_faults({**plain, **CPU_ENGINE_ENV})
    # A step touches ~36 MB (~9,000 pages); with the engine's settings, once
    # the heap has grown to a step's peak, steps fault nothing.
    assert min(eager[-4:]) > 1000, eager
    assert max(engine[-4:]) < 100, engine
