"""A served comparison's `Setup` on a temp dir, and the config one of our
launches writes, for the tests of `benchmarks.serve_compare` and
`benchmarks.spec_compare` (nothing here starts a server)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from benchmarks.serve_targets import Setup


def compare_setup(tmp_path: Path, **changes: Any) -> Setup:
    """Two CPUs, port 18100, a batch of 64, prefix caching off, vLLM's venv
    (never run) and the logs under `tmp_path`; `changes` replace fields."""
    setup = Setup(
        model=tmp_path / "model",
        dtype="float32",
        cpus=(0, 1),
        port=18100,
        max_num_seqs=64,
        max_num_tokens=2048,
        max_model_len=384,
        prefix_caching=False,
        vllm_python=tmp_path / "venv" / "bin" / "python",
        workdir=tmp_path,
    )
    return dataclasses.replace(setup, **changes)


def served_config(serve_argv: list[str]) -> dict[str, Any]:
    """The config a `disagg serve -c PATH` command line names."""
    assert serve_argv[-2] == "-c"
    return dict(yaml.safe_load(Path(serve_argv[-1]).read_text()))
