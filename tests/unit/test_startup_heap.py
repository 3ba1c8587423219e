"""runtime.startup_heap: the start-up heap leaves the cyclic collector once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process: freezing is process-wide and would outlive this test.
_CHECK = """
import gc
from runtime.startup_heap import freeze_startup_heap
assert gc.get_freeze_count() == 0
freeze_startup_heap()
frozen = gc.get_freeze_count()
assert frozen > 0, "nothing was frozen"
garbage = [[] for _ in range(1000)]
freeze_startup_heap()
assert gc.get_freeze_count() == frozen, "a second call froze again"
cycle = []
cycle.append(cycle)
del cycle
assert gc.collect() >= 1, "objects made after the freeze must still be collected"
"""


def test_freeze_once_and_later_objects_are_still_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_heap_is_unfrozen_at_exit_so_extensions_are_freed() -> None:
    """Frozen objects escape the interpreter's last collection; nanobind
    modules (triton) then report them as leaked when the process exits."""
    check = "import triton.language\nfrom runtime.startup_heap import freeze_startup_heap\n"
    check += "freeze_startup_heap()\n"
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr
