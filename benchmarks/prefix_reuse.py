"""Multi-turn chat with a shared system prompt, block reuse off and on, served.

    python -m benchmarks.prefix_reuse                       # hybrid and dense, every server
    python -m benchmarks.prefix_reuse --models hybrid --servers ours-agg ours-1p1d
    python -m benchmarks.prefix_reuse --conversations 8 --turns 4 --system-len 512 \\
        --user-len 64 --answer-len 64

The workload: `--conversations` chats of `--turns` turns. Every chat starts
with the same `--system-len` random token ids, then `--user-len` of its own;
each answer is `--answer-len` greedy tokens (EOS ignored), and the next turn's
prompt is the last prompt, the answer's token ids (asked for with
`return_tokens_as_token_ids`) and another `--user-len` user tokens. A turn's
requests go out together; the next turn starts when all have ended. Prompts
are token ids on `/v1/completions`, streamed, so TTFT is the first token's
arrival at the client.

Models: `hybrid`, a random-weight Nemotron-H (`disagg make-checkpoint --arch
nemotron_h --size mini`: M, *, - and E layers, written to
`checkpoints/mini-nemotron-h` if missing), and `dense`, SmolLM2-135M from
its packaged GGUF file. Servers, one at a time on the same CPUs
(`benchmarks.serve_targets`): `ours-agg` (one aggregated instance),
`ours-1p1d` (a context and a generation instance on the Python transceiver,
one core each, `conditional_disagg.max_local_prefill_length` set to the user
turn plus a block, so that a turn whose history the generation worker holds
runs there), both with the prefix-aware router; and `vllm-agg` (vLLM's CPU
build, `--enable-prompt-tokens-details`). Every server caches in blocks of
`--block-size` tokens (32: vLLM's CPU attention takes multiples of 32, and
its own default of 128 alone would lower its hit rate). Each runs with reuse off and on
(vLLM: prefix caching); ours with reuse on keeps `max_batch_size` snapshots.

Per run and turn the table gives TTFT p50 / p99, the prompt tokens the
server computed (prompt minus `cached_tokens`), the hit rate (cached /
prompt tokens) and, for ours 1P1D, the cache bytes pulled between workers
(`disagg_kv_transfer_bytes`). The goals at the end compare turns 2.. with
reuse on against off within one server, and ours against vLLM on the dense
model. A server that fails (vLLM's CPU build on the hybrid) is reported
with the last line of its log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.process_group import GroupProcess, check_ports_free
from benchmarks.serve_compare import resolve_model, wait_ready
from benchmarks.serve_targets import (
    DEFAULT_VLLM_PYTHON,
    ROOT,
    Launch,
    Setup,
    aggregated_sections,
    base_config,
    ours_launch,
    pinned_1p1d,
    vllm_env,
    vllm_serve_argv,
)

MODELS = ("hybrid", "dense")
SERVERS = ("ours-agg", "ours-1p1d", "vllm-agg")
HYBRID_CHECKPOINT = ROOT / "checkpoints" / "mini-nemotron-h"
FIRST_TOKEN_ID = 10  # below it: the tiny tokenizers' special tokens


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_len: int
    user_len: int
    answer_len: int
    seed: int


@dataclass
class Turn:
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_bytes: float | None = None

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Run:
    model: str
    server: str
    reuse: bool
    label: str
    turns: list[Turn] = field(default_factory=list)
    failure: str = ""


# ----------------------------------------------------------------- client


async def _ask(
    client: httpx.AsyncClient, model: str, prompt: list[int], tokens: int
) -> tuple[float, list[int], int, int]:
    """(TTFT, answer ids, prompt tokens, cached tokens) of one streamed request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first = time.monotonic(), None
    ids: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                names = (choice.get("logprobs") or {}).get("tokens") or []
                if names and first is None:
                    first = time.monotonic() - start
                ids += [int(name.removeprefix("token_id:")) for name in names]
    details = usage.get("prompt_tokens_details") or {}
    if first is None or len(ids) != tokens:
        raise RuntimeError(f"a request streamed {len(ids)} of {tokens} tokens")
    return first, ids, int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


def _kv_bytes(url: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^disagg_kv_transfer_bytes_total ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else None


async def _converse(url: str, model: str, workload: Workload, vocab: int, ours: bool) -> list[Turn]:
    """Every turn of every conversation; `ours`: also the cache bytes each turn moved."""
    rng = random.Random(workload.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]

    system = draw(workload.system_len)
    prompts = [system + draw(workload.user_len) for _ in range(workload.conversations)]
    turns = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(workload.turns):
            before = _kv_bytes(url) if ours else None
            asked = [_ask(client, model, p, workload.answer_len) for p in prompts]
            answers = await asyncio.gather(*asked)
            turn = Turn()
            for ttft, _ids, prompt_tokens, cached in answers:
                turn.ttft_s.append(ttft)
                turn.prompt_tokens += prompt_tokens
                turn.cached_tokens += cached
            if before is not None:
                after = _kv_bytes(url)
                turn.kv_bytes = None if after is None else after - before
            turns.append(turn)
            prompts = [
                p + a[1] + draw(workload.user_len) for p, a in zip(prompts, answers, strict=True)
            ]
    return turns


# ---------------------------------------------------------------- servers


def _launch(server: str, setup: Setup, workload: Workload, block_size: int) -> Launch:
    if server == "vllm-agg":
        # The block size ours uses: vLLM's CPU build otherwise caches in
        # blocks of 128 tokens, which alone lowers its hit rate here.
        extra = ["--enable-prompt-tokens-details", "--block-size", str(block_size)]
        argv = vllm_serve_argv(setup, setup.port, extra)
        log = setup.log(f"vllm-agg-{'on' if setup.prefix_caching else 'off'}")
        proc = GroupProcess("vllm-agg", argv, vllm_env(setup, setup.cpus), log, setup.cpus)
        label = f"vLLM-CPU aggregated, prefix caching {'on' if setup.prefix_caching else 'off'}"
        return Launch(label, (setup.port,), [proc], [setup.url])
    config = base_config(setup, "python")
    config["router"] = {"type": "prefix_aware"}
    config["kv_cache"]["block_size"] = block_size
    if server == "ours-agg":
        config, how = aggregated_sections(config, len(setup.cpus))
    else:
        config, how = pinned_1p1d(config, setup)
        local = workload.user_len + block_size  # a new user turn and the last answer's final token
        config["conditional_disagg"] = {"max_local_prefill_length": local}
        how += f", prefill local up to {local} uncached tokens"
    label = f"disagg {server.removeprefix('ours-')} ({how}), reuse {'on' if setup.prefix_caching else 'off'}"
    return ours_launch(setup, f"{server}-{'on' if setup.prefix_caching else 'off'}", config, label)


def measure(
    model: str, server: str, setup: Setup, workload: Workload, vocab: int, block_size: int
) -> Run:
    launch = _launch(server, setup, workload, block_size)
    run = Run(model, server, setup.prefix_caching, launch.label)
    print(f"== {model} / {launch.label}", flush=True)
    check_ports_free(launch.ports)
    try:
        for proc in launch.processes:
            proc.start()
        for i in range(len(launch.processes)):
            wait_ready(launch, i, 300)
        served = httpx.get(setup.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        ours = server.startswith("ours")
        run.turns = asyncio.run(_converse(setup.url, served, workload, vocab, ours))
    except (RuntimeError, OSError, httpx.HTTPError, KeyError) as exc:
        run.failure = _root_cause(launch.processes[0].log_path, str(exc))
        print(f"   failed: {run.failure}", flush=True)
    finally:
        for proc in reversed(launch.processes):
            proc.stop()
        check_ports_free(launch.ports)
    return run


def _root_cause(log: Path, fallback: str) -> str:
    """The first exception a server's log names other than the RuntimeError
    that wraps it (vLLM's engine start-up reports its cause first)."""
    # A traceback's last line, bare or after a log prefix ("... [file.py:953] ").
    pattern = r"(?:^|\] )(\w+(?:Error|Exception)): (.+)$"
    found = re.findall(pattern, log.read_text(errors="replace"), re.M)
    causes = [f"{kind}: {text}" for kind, text in found if kind != "RuntimeError"]
    return (causes[0] if causes else fallback).strip()[:200]


# ----------------------------------------------------------------- report


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_run(run: Run) -> None:
    if run.failure:
        print(f"{run.model:6} {run.label}: FAILED: {run.failure}")
        return
    print(f"{run.model:6} {run.label}")
    print("   turn  TTFT p50 ms  TTFT p99 ms  prefill tokens  hit rate  KV bytes moved")
    for i, turn in enumerate(run.turns, 1):
        moved = "-" if turn.kv_bytes is None else f"{turn.kv_bytes:,.0f}"
        print(
            f"   {i:4}  {1000 * statistics.median(turn.ttft_s):11.1f}  "
            f"{1000 * _p(turn.ttft_s, 0.99):11.1f}  {turn.computed:14}  {turn.hit_rate:8.0%}  {moved:>14}"
        )


def _later(run: Run) -> list[Turn]:
    return run.turns[1:]


def _ratio(on: float, off: float) -> str:
    return f"{on / off:.2f}x" if off else "n/a"


def print_goals(runs: list[Run]) -> None:
    by = {(r.model, r.server, r.reuse): r for r in runs if not r.failure and r.turns}
    print("\ngoals (turns 2.., reuse on / reuse off in the same server):")
    for model in MODELS:
        for server in ("ours-agg", "ours-1p1d"):
            on, off = by.get((model, server, True)), by.get((model, server, False))
            if on is None or off is None:
                continue
            ttft = _ratio(
                statistics.median(t for turn in _later(on) for t in turn.ttft_s),
                statistics.median(t for turn in _later(off) for t in turn.ttft_s),
            )
            computed = _ratio(
                sum(t.computed for t in _later(on)), sum(t.computed for t in _later(off))
            )
            line = f"  {model:6} {server:9}: TTFT p50 {ttft}, prefill tokens {computed}"
            if server == "ours-1p1d":
                moved_on = sum(t.kv_bytes or 0 for t in _later(on))
                moved_off = sum(t.kv_bytes or 0 for t in _later(off))
                line += f", KV bytes moved {_ratio(moved_on, moved_off)}"
            print(line)
    ours, vllm = by.get(("dense", "ours-agg", True)), by.get(("dense", "vllm-agg", True))
    if ours is not None and vllm is not None:
        hits = [
            sum(t.cached_tokens for t in _later(r)) / sum(t.prompt_tokens for t in _later(r))
            for r in (ours, vllm)
        ]
        ttft = _ratio(
            statistics.median(t for turn in _later(ours) for t in turn.ttft_s),
            statistics.median(t for turn in _later(vllm) for t in turn.ttft_s),
        )
        print(
            f"  dense  ours-agg / vLLM-agg, both reusing: TTFT p50 {ttft} at hit rates {hits[0]:.0%} / {hits[1]:.0%}"
        )
    for run in runs:
        if run.failure:
            print(
                f"  {run.model} {run.server} reuse {'on' if run.reuse else 'off'}: failed ({run.failure})"
            )


# ------------------------------------------------------------------- main


def _model(name: str) -> Path:
    if name == "hybrid":
        from models.embedded.writer import ensure_checkpoint

        return ensure_checkpoint(HYBRID_CHECKPOINT, "nemotron_h", "mini")
    return resolve_model("smollm2")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--reuse", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--answer-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="KV block size of every server (vLLM's CPU attention takes multiples of 32)",
    )
    parser.add_argument("--cpus", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the runs here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(
        args.conversations, args.turns, args.system_len, args.user_len, args.answer_len, args.seed
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="prefix-reuse-"))
    workdir.mkdir(parents=True, exist_ok=True)
    longest = workload.system_len + workload.turns * (workload.user_len + workload.answer_len)
    runs = []
    for model in args.models:
        checkpoint = _model(model)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        for server in args.servers:
            if server == "vllm-agg" and not args.vllm_python.exists():
                print(f"== {server}: skipped, no vLLM interpreter at {args.vllm_python}")
                continue
            for reuse in args.reuse:
                setup = Setup(
                    model=checkpoint.resolve(),
                    dtype="float32",
                    cpus=tuple(args.cpus),
                    port=args.port,
                    max_num_seqs=workload.conversations,
                    max_num_tokens=2048,
                    max_model_len=longest + 64,
                    prefix_caching=reuse == "on",
                    vllm_python=args.vllm_python,
                    workdir=workdir.resolve(),
                )
                runs.append(measure(model, server, setup, workload, vocab, args.block_size))
    print()
    for run in runs:
        print_run(run)
    print_goals(runs)
    if args.json is not None:
        args.json.write_text(json.dumps([_as_json(r) for r in runs], indent=1))
    return 0


def _as_json(run: Run) -> dict[str, Any]:
    return {
        "model": run.model,
        "server": run.server,
        "reuse": run.reuse,
        "label": run.label,
        "failure": run.failure,
        "turns": [vars(turn) for turn in run.turns],
    }


if __name__ == "__main__":
    sys.exit(main())
