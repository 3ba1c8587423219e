"""`disagg serve` as a subprocess for the tests that need the real command
(`benchmarks.serve_process` runs it): start it on a free loopback port and
wait for its URL; `stop_group` stops it by process group."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.serve_process import ROOT, ServeProcess, stop_group

__all__ = [
    "MODES",
    "ROOT",
    "ServeProcess",
    "start_mode",
    "start_serve",
    "start_serve_command",
    "stop_group",
]

# The serving modes a feature is held to end to end: one generation worker
# alone, 1P1D over the Python transceiver, and 1P1D with block reuse and
# n-gram speculation (each merged into `start_mode`'s 1P1D base config).
MODES: dict[str, dict[str, dict[str, object]]] = {
    "aggregated": {"context_servers": {"num_instances": 0}},
    "1p1d": {"cache_transceiver": {"backend": "python"}},
    "1p1d-reuse-ngram": {
        "cache_transceiver": {"backend": "python"},
        "kv_cache": {"enable_block_reuse": True},
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    },
}


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


def start_mode(directory: Path, checkpoint: Path, overrides: dict[str, object]) -> ServeProcess:
    """Serve `checkpoint` from a 1P1D config (every prompt goes to the context
    worker, 8 requests, 2048 cache tokens) with `overrides` (one of `MODES`,
    or any sections and keys) merged into its sections, a key that is not a
    section replaced; the config is written into `directory`."""
    config: dict[str, object] = {
        "model": str(checkpoint),
        "conditional_disagg": {"max_local_prefill_length": 0},
        "kv_cache": {"max_tokens": 2048},
        "max_batch_size": 8,
        "context_servers": {"num_instances": 1},
        "generation_servers": {"num_instances": 1},
    }
    for key, value in overrides.items():
        base = config.get(key, {})
        config[key] = (
            {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
        )
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_serve(path, checkpoint)
