"""`disagg demo`: the whole path in one command, offline, on CPU.

Starts a local 1P1D cluster in this process on the packaged
SmolLM2-135M-Instruct (or `--model`), asks a few questions through the real
HTTP chat endpoint (HTTP -> router -> context worker -> cache transfer ->
generation worker -> HTTP), streamed at temperature 0, prints each answer
with its time to first token and tokens per second, and shuts everything
down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass

import httpx

from cluster.config.plan import ClusterPlan
from cluster.config.schema import ClusterConfig, ConfigError
from cluster.serve import default_config

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
)


@dataclass(frozen=True)
class DemoResult:
    prompt: str
    text: str
    ttft_s: float
    tokens: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        decode = self.elapsed_s - self.ttft_s
        return (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="checkpoint folder or GGUF file (default: the packaged SmolLM2)"
    )
    parser.add_argument("--max-tokens", type=int, default=48)


def run(args: argparse.Namespace) -> int:
    from cluster.config.checkpoint_check import check_checkpoint
    from cluster.config.plan import format_plan, resolve_plan
    from cluster.launch.launcher import LaunchError

    key = "--model" if args.model is not None else "<demo>:model"
    try:
        config = default_config(args.model).model_copy(update={"port": 0})
        plan = resolve_plan(config, source="<demo>", model_key=key)
        check_checkpoint(plan.checkpoint, key, use_mtp=plan.uses_mtp)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan), flush=True)
    try:
        results = asyncio.run(_demo(config, plan, args.max_tokens))
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for result in results:
        print(f"\nquestion: {result.prompt}\nanswer:   {result.text.strip()}")
        print(
            f"        {result.tokens} tokens, TTFT {result.ttft_s * 1000:.0f} ms, "
            f"{result.tokens_per_s:.1f} tokens/s"
        )
    print("\ncluster stopped", flush=True)
    return 0


async def _demo(config: ClusterConfig, plan: ClusterPlan, max_tokens: int) -> list[DemoResult]:
    from cluster.serving import ServingCluster

    async with ServingCluster(config, plan) as serving:
        print(f"serving at {serving.url}", flush=True)
        async with httpx.AsyncClient(timeout=120) as client:
            model = (await client.get(f"{serving.url}/models")).json()["data"][0]["id"]
            return [
                await _ask(client, serving.url, model, question, max_tokens)
                for question in QUESTIONS
            ]


async def _ask(
    client: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int
) -> DemoResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    text, tokens = "", 0
    async with client.stream("POST", f"{url}/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content") or ""
                if first is None and content:  # not the opening role-only chunk
                    first = time.perf_counter()
                text += content
    elapsed = time.perf_counter() - started
    return DemoResult(question, text, (first or started) - started, tokens, elapsed)
