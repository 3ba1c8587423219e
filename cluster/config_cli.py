"""`disagg config`: check or convert a config file of either dialect.

    disagg config check -c trtllm-disagg.yaml [--model /path/to/checkpoint]
    disagg config convert -c trtllm-disagg.yaml [-o disagg.yaml]

`check` runs everything `disagg serve` runs before it starts a worker (the
file read in its dialect, every `auto` rule resolved into the plan, the
checkpoint checked; `cluster.serve.prepare`), without starting Ray. It prints
the plan table, each role's effective settings with the key each came from
(`cluster.config.provenance`), the config in our keys as YAML and the keys
that do not apply here, and exits 0; otherwise it prints serve's error and exits 1.
`convert` writes the config in our keys (`auto` values stay `auto`), with
the ignored keys as comments on top.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from cluster.config.reader import read_config
from cluster.config.schema import ClusterConfig, ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="resolve a config as serve would, without starting anything",
        description="Print the plan, the config in our keys and the ignored keys.",
    )
    check.add_argument("-c", "--config", required=True, help="disagg or TensorRT-LLM YAML")
    check.add_argument("--model", help="checkpoint folder; overrides the config's `model`")
    check.set_defaults(_action=run_check, host=None, port=None, api_key=None)
    convert = actions.add_parser(
        "convert",
        help="write a config (either dialect) in our keys",
        description="Write the config in our keys as YAML; auto values stay auto.",
    )
    convert.add_argument("-c", "--config", required=True, help="disagg or TensorRT-LLM YAML")
    convert.add_argument("-o", "--output", help="file to write (default: standard output)")
    convert.set_defaults(_action=run_convert)


def run(args: argparse.Namespace) -> int:
    return int(args._action(args))


def run_check(args: argparse.Namespace) -> int:
    from cluster.config.plan import format_plan
    from cluster.config.provenance import format_sources
    from cluster.serve import format_ignored, prepare

    try:
        loaded, plan = prepare(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_plan(plan))
    print(f"\n{format_sources(loaded, plan)}")
    print(f"\nconfig in disagg keys:\n{native_yaml(loaded.config)}")
    print(format_ignored(loaded))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    try:
        loaded = read_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    header = [f"# {args.config} ({loaded.dialect} keys) written in disagg keys"]
    if loaded.ignored:
        header.append("# keys that do not apply here (ignored):")
        header += [f"#   {item}" for item in loaded.ignored]
    text = "\n".join(header) + "\n" + native_yaml(loaded.config)
    if args.output is None:
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


def native_yaml(config: ClusterConfig) -> str:
    """The keys the config sets, as a disagg YAML file."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True), sort_keys=False)
