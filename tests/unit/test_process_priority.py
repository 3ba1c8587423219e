"""`lower_process_priority`: every thread of the process, and threads started
later, run at the niceness asked for; a nicer thread keeps its own.

Niceness cannot be lowered again without privileges, so each case runs in a
fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
