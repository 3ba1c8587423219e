"""`disagg serve`: run the cluster behind an OpenAI-compatible endpoint.

    disagg serve -c deploy/configs/1p1d.yaml
    disagg serve                                 # 1P1D on the packaged SmolLM2-135M-Instruct
    disagg serve --model model.Q4_K_M.gguf       # a GGUF file (or a folder holding one)
    disagg serve -c cfg.yaml --model /ckpt --port 0

The config is validated and every `auto` resolved before anything starts;
a bad config exits with status 2 and one message. Once every worker is
healthy the URL is printed on its own line (`serving <model> at <url>`);
SIGINT or SIGTERM shuts everything down and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The server's loop is uvloop's, as is every worker actor's (Ray picks uvloop
# whenever it is installed), and uvicorn parses HTTP with httptools: with one
# SSE chunk per token per stream, the stdlib loop and h11 spent a fifth of
# the whole served stack's CPU time at full load.
import uvloop

from cluster.config.reader import LoadedConfig, read_config
from cluster.config.schema import ClusterConfig, ConfigError, config_from_dict

if TYPE_CHECKING:
    from cluster.config.plan import ClusterPlan

API_KEY_ENV = "DISAGG_API_KEY"


def default_config(model: str | None = None) -> ClusterConfig:
    """The embedded default: one context and one generation instance on CPU,
    serving `model` or else the packaged SmolLM2 (`ConfigError` if it is absent)."""
    from cluster.config.default_model import default_model_file

    return config_from_dict(
        {
            "model": model or str(default_model_file()),
            "cache_transceiver": {"backend": "python"},
            "kv_cache": {"max_tokens": 4096},
            "max_num_tokens": 512,
            "max_batch_size": 16,
        },
        source="<embedded default>",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", help="disagg YAML config (default: embedded 1P1D)")
    parser.add_argument(
        "--model", help="checkpoint folder or GGUF file; overrides the config's `model`"
    )
    parser.add_argument("--host", help="bind address; overrides the config's `hostname`")
    parser.add_argument("--port", type=int, help="port (0 picks a free one); overrides `port`")
    parser.add_argument(
        "--address",
        help="Ray cluster to join (`auto` on a `ray up` head); overrides `address`",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"bearer token the /v1 API requires (default: ${API_KEY_ENV}); overrides `api_key`",
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn and worker log level")


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """The config file (or the embedded default) with command-line overrides."""
    return read_args_config(args).config


def read_args_config(args: argparse.Namespace) -> LoadedConfig:
    """`build_config`, keeping the file's dialect and the keys it ignored."""
    if args.config is None:
        loaded = LoadedConfig(default_config(args.model), "disagg")
    else:
        loaded = read_config(args.config)
    overrides: dict[str, Any] = {}
    if args.model is not None:
        overrides["model"] = args.model
    if args.host is not None:
        overrides["hostname"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if getattr(args, "address", None) is not None:
        overrides["address"] = args.address
    if getattr(args, "api_key", None) is not None:
        overrides["api_key"] = args.api_key
    if not overrides:
        return loaded
    raw = loaded.config.model_dump(exclude_unset=True) | overrides
    config = config_from_dict(raw, source=args.config or "<embedded default>")
    return dataclasses.replace(loaded, config=config)


def prepare(args: argparse.Namespace) -> tuple[LoadedConfig, ClusterPlan]:
    """Everything `serve` checks before it starts anything: the config, every
    `auto` resolved into the plan, and the checkpoint. Raises `ConfigError`."""
    from cluster.config.checkpoint_check import check_checkpoint
    from cluster.config.plan import resolve_plan

    source = args.config or "<embedded default>"
    loaded = read_args_config(args)
    key = model_key(args)
    plan = resolve_plan(loaded.config, source=source, model_key=key)
    check_checkpoint(plan.checkpoint, key, use_mtp=plan.uses_mtp)
    return loaded, plan


def model_key(args: argparse.Namespace) -> str:
    """Where the served model was named, as its errors start: `--model`
    when the flag gave it, else the config's `model` key."""
    if args.model is not None:
        return "--model"
    return f"{args.config or '<embedded default>'}:model"


def format_ignored(loaded: LoadedConfig) -> str:
    """The keys a translated file set that do not apply here, one a line."""
    if not loaded.ignored:
        return f"{loaded.dialect} config: no key ignored"
    count = len(loaded.ignored)
    keys = "1 key does" if count == 1 else f"{count} keys do"
    lines = [f"{loaded.dialect} config: {keys} not apply here (ignored):"]
    return "\n".join(lines + [f"  {item}" for item in loaded.ignored])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from cluster.config.plan import format_plan
    from cluster.launch.launcher import LaunchError

    try:
        loaded, plan = prepare(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if loaded.ignored:
        print(format_ignored(loaded), flush=True)
    print(format_plan(plan), flush=True)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(loaded.config, plan, args.log_level))
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    print("stopped", flush=True)
    return 0


async def _serve(config: ClusterConfig, plan: Any, log_level: str) -> None:
    from cluster.serving import ServingCluster

    async with ServingCluster(config, plan, log_level) as serving:
        assert serving.cluster is not None
        print(serving.cluster.placement(), flush=True)
        print(f"serving {Path(plan.checkpoint).resolve().name} at {serving.url}", flush=True)
        await serving.wait_stopped()
