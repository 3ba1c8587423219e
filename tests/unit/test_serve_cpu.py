"""benchmarks.serve_cpu: CPU-seconds per process role and py-spy summaries."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.serve_cpu import by_role, cpu_seconds, role, top_functions


def test_top_functions_counts_own_and_total_samples(tmp_path: Path) -> None:
    raw = tmp_path / "server.raw"
    raw.write_text("main;serve;send 3\nmain;serve;decode 1\nmain;poll 4\n")
    top = top_functions(raw, count=2).splitlines()
    assert top[0] == "8 samples"
    own = top[top.index("-- top 2 by own samples") + 1 :][:2]
    assert own == [" 50.0%  poll", " 37.5%  send"]
    total = top[top.index("-- top 2 by total samples") + 1 :]
    assert total == ["100.0%  main", " 50.0%  serve"]


def test_cpu_seconds_of_this_process_are_counted_as_the_serving_process() -> None:
    me = os.getpid()
    assert role(me, me) == "serving process (HTTP + router)"
    before = cpu_seconds(me)
    sum(i * i for i in range(2_000_000))  # burn a little CPU
    spent = by_role(before, cpu_seconds(me), me)
    assert spent["serving process (HTTP + router)"] > 0
