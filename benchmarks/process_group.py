"""Child processes a benchmark starts and must stop completely, and the ports they hold.

    with GroupProcess("vllm", argv, env, log_path, cpus=[0]) as proc:
        ...                          # proc.alive(), proc.log_tail()
    # left: SIGTERM to the leader, a grace period, then SIGKILL to its process
    # group and to every descendant seen while it ran (Ray and vLLM start
    # helpers that outlive their parent or leave its group)

    check_ports_free([8000, 8001])   # PortBusy names the port and its listener

Each child runs in a session of its own, so a Ctrl-C in the terminal reaches
only the benchmark, which then stops its children in order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

_LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp


class PortBusy(RuntimeError):
    """A port a server is about to bind is still held by another process."""


def cpu_list(cpus: Iterable[int]) -> str:
    """`cpus` as taskset and OpenMP bindings spell them: "0,1"."""
    return ",".join(str(c) for c in cpus)


def pinned(argv: list[str], cpus: Iterable[int] | None) -> list[str]:
    """`argv` run under `taskset` on `cpus`; unchanged for None."""
    return argv if cpus is None else ["taskset", "-c", cpu_list(cpus), *argv]


class GroupProcess:
    """`argv` in its own session (process group), output appended to `log_path`.

    cpus: pin the process (and so everything it starts) to these CPUs with
        `taskset`; None leaves the affinity as inherited.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        cpus: Iterable[int] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = pinned(argv, cpus)
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, str] = {}  # descendant pid -> its start time (pid reuse guard)

    def __enter__(self) -> GroupProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        self.remember_descendants()
        return self.process is not None and self.process.poll() is None

    def remember_descendants(self) -> None:
        """Record the current process tree, so `stop` can reach processes that left it."""
        if self.process is not None:
            for pid in descendants(self.process.pid):
                self._seen.setdefault(pid, _start_time(pid))

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the leader, wait `grace_s`, then SIGKILL whatever of it is left."""
        if self.process is None:
            return
        self.remember_descendants()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid, started in self._seen.items():
            if _start_time(pid) == started:  # still the process we saw, not a reused pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def descendants(root_pid: int) -> list[int]:
    """Every process below `root_pid` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        stat = _stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None:
            ppid = int(stat[1][1])  # field 4
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    stack = list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def tree_cpu_seconds(root_pids: Iterable[int]) -> dict[tuple[int, str], tuple[str, float]]:
    """User + system CPU-seconds of every process in the trees under
    `root_pids` (roots included), keyed by (pid, start time), with each
    process's name (the kernel's `comm`, e.g. "raylet" or
    "ray::GenerationW"). Take one before and one after a run and subtract
    with `cpu_by_name`: processes that exit in between drop out."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[tuple[int, str], tuple[str, float]] = {}
    for root in root_pids:
        for pid in (root, *descendants(root)):
            stat = _stat(pid)
            if stat is not None:
                name, fields = stat
                # fields 14 and 15 (utime, stime) and 22 (start time)
                found[(pid, fields[19])] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def cpu_by_name(
    before: dict[tuple[int, str], tuple[str, float]],
    after: dict[tuple[int, str], tuple[str, float]],
) -> dict[str, float]:
    """CPU-seconds each process name took between two `tree_cpu_seconds`
    snapshots (a process that started in between counts from zero), most first."""
    spent: dict[str, float] = {}
    for key, (name, cpu) in after.items():
        spent[name] = spent.get(name, 0.0) + cpu - before.get(key, (name, 0.0))[1]
    return dict(sorted(spent.items(), key=lambda item: -item[1]))


def _start_time(pid: int) -> str:
    stat = _stat(pid)
    return stat[1][19] if stat is not None and len(stat[1]) > 19 else ""


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """`/proc/<pid>/stat` as the command name (field 2, which may hold spaces
    and parentheses) and the fields after it (field 3 first); None once the
    process has gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, rest = stat.rpartition(")")
    return head.split("(", 1)[1], rest.split()


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on `host:port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def listener_pid(port: int) -> int | None:
    """The pid of a process listening on TCP `port` (IPv4 or IPv6), if this user can see it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN_STATE and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # the process ended, or is not ours to read
            continue
        for fd in fds:
            # A descriptor may close while we look (another thread of the
            # owner): skip it, not the rest of the process's descriptors.
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return int(entry.name)
    return None


def check_ports_free(ports: Iterable[int], wait_s: float = 30.0) -> None:
    """Wait up to `wait_s` for every port to be free; `PortBusy` names the first one held."""
    deadline = time.monotonic() + wait_s
    for port in ports:
        while port_in_use(port):
            if time.monotonic() >= deadline:
                raise PortBusy(_busy_message(port))
            time.sleep(0.5)


def _busy_message(port: int) -> str:
    pid = listener_pid(port)
    if pid is None:
        return f"port {port} is in use by another process; free it or pass another --port"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        command = "?"
    return f"port {port} is in use by pid {pid} ({command[:120]}); stop it or pass another --port"
