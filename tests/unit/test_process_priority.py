"""`serving_nice` resolved from the plan, and `lower_process_priority`: every
thread of the process, and threads started later, run at the niceness asked
for; a nicer thread keeps its own.

Niceness cannot be lowered again without privileges, so those cases run in a
fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from cluster.config import config_from_dict
from cluster.plan import resolve_plan
from cluster.process_priority import MULTI_THREADED_NICENESS, serving_niceness
from models.embedded.configs import checkpoint_config

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys, threading
from cluster.process_priority import lower_process_priority

def niceness(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)

release = threading.Event()
tids = {}

def park(name):
    tids[name] = threading.get_native_id()
    release.wait()

before = threading.Thread(target=park, args=("before",))
before.start()
nicer = threading.Thread(target=lambda: (os.setpriority(os.PRIO_PROCESS, 0, 15), park("nicer")))
nicer.start()
while len(tids) < 2:
    pass
lower_process_priority(int(sys.argv[1]))
after = threading.Thread(target=park, args=("after",))
after.start()
while len(tids) < 3:
    pass
seen = {name: niceness(tid) for name, tid in tids.items()}
seen["main"] = niceness(threading.get_native_id())
release.set()
print(json.dumps(seen))
"""


def run(niceness: int) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(niceness)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return dict(json.loads(out.stdout))


def test_every_thread_and_later_ones_get_the_niceness_a_nicer_one_keeps_its_own() -> None:
    base = run(0)
    own = base["main"]
    assert base == {"before": own, "nicer": 15, "after": own, "main": own}
    target = max(own + 3, 5)
    assert run(target) == {"before": target, "nicer": 15, "after": target, "main": target}


def _niceness(tmp_path: Path, **overrides: Any) -> int:
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config("llama", "tiny")))
    raw = {"model": str(tmp_path), "cache_transceiver": {"backend": "python"}, **overrides}
    config = config_from_dict(raw)
    return serving_niceness(config.serving_nice, resolve_plan(config).instances)


def test_auto_yields_only_to_multi_threaded_cpu_workers(tmp_path: Path) -> None:
    assert _niceness(tmp_path) == 0  # 1P1D, one thread each
    aggregated = {"context_servers": {"num_instances": 0}}
    two_threads = aggregated | {"generation_servers": {"num_instances": 1, "num_cpus": 2}}
    assert _niceness(tmp_path, **aggregated) == 0
    assert _niceness(tmp_path, **two_threads) == MULTI_THREADED_NICENESS
    assert _niceness(tmp_path, **two_threads, serving_nice=0) == 0
    assert _niceness(tmp_path, serving_nice=3) == 3
