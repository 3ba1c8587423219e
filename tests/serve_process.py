"""`disagg serve` as a subprocess in its own process group, for the tests that
need the real command: start it, wait for its URL, stop it by process group.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    url: str
    output: list[str]

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")


def start_serve(config: Path, checkpoint: Path, env: dict[str, str] | None = None) -> ServeProcess:
    """Run `disagg serve -c config --model checkpoint` on a free loopback port;
    return once it prints its URL (raise with its output if it exits first)."""
    command = [sys.executable, "-m", "cluster.cli", "serve", "-c", str(config)]
    command += ["--model", str(checkpoint), "--host", "127.0.0.1", "--port", "0"]
    return start_serve_command(command, ROOT, env)


def start_serve_command(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> ServeProcess:
    """`start_serve` for a command line of the caller's (it must serve on loopback)."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # its own process group, like a terminal's job
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def drain() -> None:  # keep the pipe empty so the server never blocks on it
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        match = re.match(r"serving \S+ at (http://\S+)", line)
        if match:
            return ServeProcess(process, match.group(1), output)
    stop_group(process)
    raise AssertionError("disagg serve did not start:\n" + "".join(output[-40:]))


def stop_group(process: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    """SIGTERM the process's whole group (what Ctrl-C in a terminal reaches),
    then SIGKILL it if it has not exited within `timeout_s`."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        process.wait()
