"""benchmarks.serve_cpu: CPU-seconds per process role and the profile summary."""

from __future__ import annotations

import cProfile
import os
from pathlib import Path

from benchmarks.serve_compare import make_setup
from benchmarks.serve_cpu import (
    CLIENT,
    by_role,
    cpu_seconds,
    engine_totals,
    format_engines,
    format_spent,
    hot_functions,
    parse_args,
    role,
)
from cluster.api.stop_strings import StopStringFilter


def _hot(n: int) -> int:
    return sum(i * i for i in range(n))


def _serve_like() -> None:
    """300 calls of a serving-path function, one of another, and 300 of one
    outside the serving path."""
    stops = StopStringFilter(["END"])
    for _ in range(300):
        stops.add("text ")
        _hot(10)
    stops.finish()


def test_hot_functions_keep_serving_functions_called_often(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.runcall(_serve_like)
    profile.dump_stats(tmp_path / "p.prof")
    top = hot_functions(tmp_path / "p.prof", min_calls=300)
    assert "add (stop_strings.py:" in top  # 300 calls, a serving module
    assert "finish (stop_strings.py:" not in top  # called once
    assert "_hot (" not in top  # not on the serving path


def test_cpu_seconds_of_this_process_are_counted_as_the_serving_process() -> None:
    me = os.getpid()
    assert role(me, me) == "serving process (HTTP + router)"
    before = cpu_seconds(me)
    _hot(2_000_000)  # burn a little CPU
    spent = by_role(before, cpu_seconds(me), me)
    assert spent["serving process (HTTP + router)"] > 0


METRICS_BEFORE = """# HELP disagg_engine_steps Engine steps each worker ran since it started, as last polled.
# TYPE disagg_engine_steps gauge
disagg_engine_steps{worker="generation-0"} 100.0
disagg_engine_busy_seconds{worker="generation-0"} 2.5
disagg_worker_requests{worker="generation-0"} 0.0
"""
METRICS_AFTER = """disagg_engine_steps{worker="generation-0"} 173.0
disagg_engine_busy_seconds{worker="generation-0"} 4.25
disagg_engine_steps{worker="context-0"} 9.0
disagg_engine_busy_seconds{worker="context-0"} 0.5
"""


def test_engine_lines_give_steps_and_busy_time_during_the_run() -> None:
    before, after = engine_totals(METRICS_BEFORE), engine_totals(METRICS_AFTER)
    assert before == {"generation-0": (100.0, 2.5)}
    lines = format_engines(before, after, wall_s=2.0).splitlines()
    assert lines == [
        "   engine context-0: 9 steps, busy 0.50 s of 2.00 s wall (25%), idle 1.50 s",
        "   engine generation-0: 73 steps, busy 1.75 s of 2.00 s wall (88%), idle 0.25 s",
    ]


def test_its_arguments_make_a_setup_without_a_vllm_install(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = parse_args(["--model", str(tmp_path), "--workdir", str(tmp_path / "logs")])
    setup = make_setup(args)
    assert setup.model == tmp_path.resolve() and setup.cpus == (0, 1)
    assert setup.pin_instances and setup.first_token_at is None and not setup.prefix_caching


def test_format_spent_sums_roles_against_the_cpus_and_prices_tokens() -> None:
    spent = {"GenerationWorker": 3.0, role(0, 0): 0.4, CLIENT: 0.6}
    text = format_spent("run 0", spent, wall_s=2.5, tokens=4000, cpus=2)
    assert text.splitlines()[0] == "run 0: 2.5 s wall, 4.00 CPU-s in all (80% of 2 CPUs)"
    assert "serving process (HTTP + router): 100 us CPU per output token" in text
    assert "client (this process): 150 us CPU per output token" in text
