"""benchmarks.serve_cpu: CPU-seconds per process role and the profile summary."""

from __future__ import annotations

import cProfile
import os
from pathlib import Path

from benchmarks.serve_cpu import by_role, cpu_seconds, hot_functions, role


def _hot(n: int) -> int:
    return sum(i * i for i in range(n))


def _once() -> int:
    return sum(_hot(200) for _ in range(300))


def test_hot_functions_keep_only_functions_called_often(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.runcall(_once)
    profile.dump_stats(tmp_path / "p.prof")
    top = hot_functions(tmp_path / "p.prof", min_calls=300)
    assert "_hot (" in top and "_once (" not in top  # _once ran once
    own = top.splitlines()[2]
    assert own.split()[1] in ("300", "60300")  # _hot itself or its generator


def test_cpu_seconds_of_this_process_are_counted_as_the_serving_process() -> None:
    me = os.getpid()
    assert role(me, me) == "serving process (HTTP + router)"
    before = cpu_seconds(me)
    _hot(2_000_000)  # burn a little CPU
    spent = by_role(before, cpu_seconds(me), me)
    assert spent["serving process (HTTP + router)"] > 0
