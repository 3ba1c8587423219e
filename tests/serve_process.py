"""`disagg serve` as a subprocess for the tests that need the real command
(`benchmarks.serve_process` runs it): start it on a free loopback port and
wait for its URL; `stop_group` stops it by process group."""

from __future__ import annotations

from pathlib import Path

from benchmarks.serve_process import ROOT, ServeProcess, stop_group

__all__ = ["ROOT", "ServeProcess", "start_serve", "start_serve_command", "stop_group"]


def start_serve(config: Path, checkpoint: Path, env: dict[str, str] | None = None) -> ServeProcess:
    """Run `disagg serve -c config --model checkpoint` on a free loopback port;
    return once it prints its URL (raise with its output if it exits first)."""
    args = ("--model", str(checkpoint), "--host", "127.0.0.1", "--port", "0")
    return ServeProcess(config, args, env).start()


def start_serve_command(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> ServeProcess:
    """`start_serve` for a command line of the caller's (it must serve on loopback)."""
    return ServeProcess(None, env=env, command=command, cwd=cwd).start()
