"""All of an engine's torch work runs on one compute thread per process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from decode_worker.worker import GenerationWorker
from engine.instance import EngineInstance
from engine.messages import GenerationRequest
from engine.sampling import SamplingParams
from engine.threads import run_on_compute_thread
from engine.worker_config import WorkerConfig
from models.embedded.writer import write_checkpoint


def test_run_on_compute_thread_runs_there_and_nests_without_deadlock() -> None:
    name = run_on_compute_thread(lambda: threading.current_thread().name)
    assert name.startswith("torch-compute") and name != threading.current_thread().name
    nested = run_on_compute_thread(lambda: run_on_compute_thread(lambda: threading.get_ident()))
    assert nested == run_on_compute_thread(threading.get_ident)
    with pytest.raises(ZeroDivisionError):
        run_on_compute_thread(lambda: 1 // 0)


async def test_a_worker_builds_and_runs_its_model_on_the_compute_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checkpoint(tmp_path, "llama", "tiny")
    build_threads: list[int] = []
    build = EngineInstance.build

    def recording_build(*args: Any) -> EngineInstance:
        build_threads.append(threading.get_ident())
        return build(*args)

    monkeypatch.setattr(EngineInstance, "build", recording_build)
    worker = GenerationWorker(
        WorkerConfig(checkpoint=str(tmp_path), block_size=4, max_tokens=256), "t", "aggregated"
    )
    compute = run_on_compute_thread(threading.get_ident)
    step_threads: set[int] = set()
    execute = worker.engine.core.execute

    def recording_execute(plan):  # type: ignore[no-untyped-def]
        step_threads.add(threading.get_ident())
        return execute(plan)

    worker.engine.core.execute = recording_execute  # type: ignore[method-assign]
    await worker.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        request = GenerationRequest("r", [5, 6, 7], params, None)
        events = [event async for event in worker.generate(request)]
        assert sum(len(e.token_ids) for e in events) == 4
    finally:
        await worker.shutdown()
    # One thread builds the model and cache and runs every step's model: one
    # OpenMP team in the process.
    assert build_threads == [compute] and step_threads == {compute}


_PIN_CHILD = """
import os, sys, threading
from engine.threads import CpuAffinityError, pin_process

cpu = min(os.sched_getaffinity(0))
waiting = threading.Event()
early = threading.Thread(target=waiting.wait)  # a thread that exists before the pin
early.start()
pin_process([cpu])
late = threading.Thread(target=waiting.wait)
late.start()
masks = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
waiting.set()
try:
    pin_process([10_000])
except CpuAffinityError as exc:
    refused = str(exc)
print(masks == {frozenset([cpu])}, "cpu_affinity must name CPUs" in refused)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_process_pins_every_thread_and_refuses_cpus_it_cannot_use() -> None:
    # In a child process: pinning the test process would slow every later test.
    out = subprocess.run(
        [sys.executable, "-c", _PIN_CHILD],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout
    assert out.split() == ["True", "True"]
