"""`disagg serve` as a child process: start it, find its URL, measure it, stop it.

    with ServeProcess(config_path, env={"DISAGG_API_KEY": "k"}) as server:
        httpx.get(server.url + "/models")
        server.rss_bytes()            # the whole process tree: server, Ray, workers

Used by the load benchmarks and the integration tests that drive the server
from outside, exactly as a user would.
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
from pathlib import Path
from types import TracebackType

from benchmarks.process_group import descendants

ROOT = Path(__file__).resolve().parents[1]
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ServeProcess:
    """A running `disagg serve -c config` (`config` None: the embedded default);
    `url` is its `/v1` base once entered.

    Entering waits (up to `startup_timeout_s`) for the `serving ... at URL`
    line and raises `RuntimeError` with the output's tail if it never comes.
    Leaving sends SIGTERM and waits for a clean exit (SIGKILL after 60 s).
    """

    def __init__(
        self,
        config: Path | None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
    ) -> None:
        self.command = [sys.executable, "-m", "cluster.cli", "serve"]
        self.command += ["-c", str(config)] if config is not None else []  # None: the default
        self.command += list(extra_args)
        self.env = os.environ | (env or {})
        self.startup_timeout_s = startup_timeout_s
        self.output: list[str] = []
        self.url = ""
        self._lines: queue.Queue[str] = queue.Queue()
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServeProcess:
        self.process = subprocess.Popen(
            self.command,
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            self.url = self._wait_for_url()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not started"
        return self.process.pid

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process below it (Ray, workers)."""
        return process_tree_rss(self.pid)

    def stop(self) -> int | None:
        """SIGTERM, wait for the exit; returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def _drain(self) -> None:  # keep the pipe empty so the server never blocks on it
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self._lines.put(line)

    def _wait_for_url(self) -> str:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            match = re.match(r"serving \S+ at (http://\S+)", line)
            if match:
                return match.group(1)
        raise RuntimeError("disagg serve did not start:\n" + "".join(self.output[-40:]))


def process_tree_rss(root_pid: int) -> int:
    """Sum of resident set sizes of `root_pid` and all its descendants (Linux /proc)."""
    total = 0
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_SIZE
        except (OSError, IndexError, ValueError):
            continue  # the process exited while we looked
    return total
