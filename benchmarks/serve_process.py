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
    """A running `disagg serve -c config` (`config` None: the embedded default),
    or any `command` that starts one; `url` is its `/v1` base once started.

    It runs in its own process group, like a terminal's job. `start()` (or
    entering) waits up to `startup_timeout_s` for the `serving ... at URL`
    line and raises `RuntimeError` with the output's tail if it never comes.
    `stop()` (or leaving) sends SIGTERM to the whole group, what Ctrl-C in a
    terminal reaches, and SIGKILLs it if it has not exited within 60 s.
    """

    def __init__(
        self,
        config: Path | None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
        *,
        command: list[str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        if command is None:
            command = [sys.executable, "-m", "cluster.cli", "serve"]
            command += ["-c", str(config)] if config is not None else []  # None: the default
            command += list(extra_args)
        self.command = command
        self.cwd = cwd
        self.env = os.environ | (env or {})
        self.startup_timeout_s = startup_timeout_s
        self.output: list[str] = []
        self.url = ""
        self._lines: queue.Queue[str] = queue.Queue()
        self._process: subprocess.Popen[str] | None = None
        self._drainer: threading.Thread | None = None

    def start(self) -> ServeProcess:
        self._process = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        try:
            self.url = self._wait_for_url()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def process(self) -> subprocess.Popen[str]:
        assert self._process is not None, "the server is not started"
        return self._process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base(self) -> str:
        """The server's root URL (`url` without `/v1`), where `/metrics` is."""
        return self.url.removesuffix("/v1")

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process below it (Ray, workers)."""
        return process_tree_rss(self.pid)

    def stop(self) -> int | None:
        """Stop the process group; returns the server's exit status. `output`
        then holds what it printed to the end (once every process of the group
        closed the pipe, or after 10 s)."""
        if self._process is None:
            return None
        stop_group(self._process)
        if self._drainer is not None:
            self._drainer.join(10.0)
        return self._process.returncode

    def _drain(self) -> None:  # keep the pipe empty so the server never blocks on it
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self.output.append(line)
            self._lines.put(line)

    def _wait_for_url(self) -> str:
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


def process_tree_rss(root_pid: int) -> int:
    """Sum of resident set sizes of `root_pid` and all its descendants (Linux /proc)."""
    total = 0
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_SIZE
        except (OSError, IndexError, ValueError):
            continue  # the process exited while we looked
    return total
