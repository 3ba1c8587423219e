"""The `disagg` command line: one subcommand per user task.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only dispatches, so `disagg --help` stays fast
(no torch or Ray import until a subcommand runs).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "make-checkpoint": (
        "models.embedded.cli",
        "write a tiny or small Hugging Face style checkpoint, offline",
    ),
    "serve": ("cluster.serve", "run the cluster behind an OpenAI-compatible HTTP endpoint"),
    "bench": ("cluster.bench.load", "load-test any OpenAI-compatible endpoint"),
    "demo": ("cluster.demo", "start a local 1P1D cluster, send a few completions, stop"),
    "config": (
        "cluster.config_cli",
        "check a config (ours or TensorRT-LLM's) as serve would, or convert it to ours",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg", description="Disaggregated prefill/decode LLM serving on Ray."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. An error that says what to change (a config, a
    checkpoint, a tokenizer) is one `error:` line and exit status 2 wherever
    it is raised; anything else is a bug and keeps its traceback."""
    from cluster.config.schema import ConfigError
    from models.errors import CheckpointError, TokenizerError
    from models.errors import ConfigError as ModelConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except (ConfigError, ModelConfigError, CheckpointError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
