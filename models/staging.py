"""Folders written under a temporary name and renamed into place when complete.

    <parent>/<name>.tmp-<pid>   while it is written (by process <pid>)
    <parent>/<name>             complete

A folder under its final name is therefore always whole; a writer that dies
leaves only its temporary folder, which the next writer of that name removes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def staging_path(final: Path) -> Path:
    """Where this process writes `final` before renaming it."""
    return final.with_name(f"{final.name}.tmp-{os.getpid()}")


def remove_abandoned(final: Path) -> None:
    """Drop temporary folders of `final` whose writing process is gone."""
    for staging in final.parent.glob(f"{final.name}.tmp-*"):
        pid = staging.name.rsplit("-", 1)[1]
        if not (pid.isdigit() and _is_running(int(pid))):
            shutil.rmtree(staging, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
