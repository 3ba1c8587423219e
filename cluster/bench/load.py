"""`disagg bench`: a load generator for any OpenAI-compatible endpoint.

    disagg bench --base-url http://127.0.0.1:8000/v1 --num-prompts 200 \\
        --input-len 256 --output-len 64 --request-rate 8 --slo-ttft-ms 500 --json

Prompts are random (`--range-ratio` > 0 varies their length) or fixed-length
word sequences; with `--tokenizer CHECKPOINT` they are token id lists of
exactly `--input-len` tokens. Requests arrive as a Poisson process at
`--request-rate` per second (default: all at once), with at most
`--max-concurrency` in flight. Every request streams, so TTFT and the
inter-token gaps are measured on the client side. Where the server's
`/metrics` reports speculative decoding (ours or vLLM's), the summary adds
the run's acceptance rate and mean accepted length (`cluster.bench.speculation`).

Against a server that needs an API key, pass it with `--api-key` or set
`OPENAI_API_KEY` (what the `openai` client reads); a 401 says the key was
missing or refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from cluster.bench.speculation import format_speculation, read_settled, read_spec_totals, run_totals
from cluster.bench.stats import SLO, RequestRecord, format_summary, summarize

# Where the key comes from without `--api-key`: what the `openai` client reads.
API_KEY_ENV = "OPENAI_API_KEY"

_WORDS = [
    "time",
    "river",
    "clock",
    "light",
    "ocean",
    "forest",
    "mountain",
    "city",
    "winter",
    "summer",
    "rain",
    "snow",
    "wind",
    "stone",
    "bridge",
    "garden",
    "window",
    "letter",
    "story",
    "music",
    "paper",
    "engine",
    "signal",
    "number",
    "market",
]


class KeyRefusedError(RuntimeError):
    """The server answered 401: it needs an API key and had none, or not its own."""


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]
    prompt_tokens: int
    output_tokens: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="server URL, with or without /v1 (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        help=f"bearer token the server requires (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument("--model", help="model id (default: the first of /v1/models)")
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: %(default)s)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=100, help="requests to send (default: %(default)s)"
    )
    parser.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens (or words) (default: %(default)s)"
    )
    parser.add_argument(
        "--output-len", type=int, default=32, help="max_tokens per request (default: %(default)s)"
    )
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths in [len*(1-r), len*(1+r)]; 0 = fixed-length prompts "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        help="checkpoint folder: send exact-length token ids (default: words, no tokenizer)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrivals per second, Poisson (default: %(default)s, all at once)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no limit)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM ext.)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of prompts and arrivals (default: %(default)s)"
    )
    parser.add_argument("--slo-ttft-ms", type=float, help="TTFT objective (default: none)")
    parser.add_argument("--slo-tpot-ms", type=float, help="TPOT objective (default: none)")
    parser.add_argument("--slo-e2e-ms", type=float, help="E2E latency objective (default: none)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--plot", help="write latency percentiles + token timelines to a PNG (default: none)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def make_prompts(args: argparse.Namespace) -> list[BenchPrompt]:
    rng = random.Random(args.seed)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None

    def length(mean: int) -> int:
        spread = int(mean * args.range_ratio)
        return max(1, rng.randint(mean - spread, mean + spread))

    prompts = []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len), length(args.output_len)
        if tokenizer is not None:
            vocab = tokenizer.vocab_size
            ids = [rng.randrange(min(vocab, 256), vocab) for _ in range(n_in)]
            prompts.append(BenchPrompt(ids, n_in, n_out))
        else:
            text = " ".join(rng.choice(_WORDS) for _ in range(n_in))
            prompts.append(BenchPrompt(text, n_in, n_out))
    return prompts


def _load_tokenizer(path: str) -> Any:
    from models.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _body(args: argparse.Namespace, model: str, prompt: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        text = (
            prompt.prompt if isinstance(prompt.prompt, str) else " ".join(map(str, prompt.prompt))
        )
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt.prompt
    return body


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt: BenchPrompt
) -> RequestRecord:
    record = RequestRecord(sent=time.perf_counter(), prompt_tokens=prompt.prompt_tokens)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                if response.status_code == 401:
                    record.error = refused_message(url, client, text)
                else:
                    record.error = f"HTTP {response.status_code}: {text[:200]}"
                return record
            async for line in response.aiter_lines():
                _consume(line, record)
        if not record.output_tokens:
            # An endpoint that sends no usage: count one token per text chunk.
            record.output_tokens = len(record.chunk_times)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _consume(line: str, record: RequestRecord) -> None:
    """Account one SSE line: a text chunk, the usage chunk or an error."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    chunk = json.loads(line[6:])
    if "error" in chunk:
        record.error = str(chunk["error"].get("message"))
        return
    if chunk.get("usage"):
        record.output_tokens = int(chunk["usage"]["completion_tokens"])
        record.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
        return
    for choice in chunk.get("choices", []):
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            record.chunk_times.append(time.perf_counter())
            record.chunk_tokens.append(1)


async def run_benchmark(
    args: argparse.Namespace, prompts: list[BenchPrompt]
) -> tuple[list[RequestRecord], float]:
    """Send every prompt; returns the records and the wall time of the run."""
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(prompts) or 1)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)
    headers = {"Authorization": f"Bearer {key}"} if (key := api_key(args)) else {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        base = api_base(args.base_url)
        model = args.model or await _first_model(client, base)
        path = "/chat/completions" if args.endpoint == "chat" else "/completions"
        url = base + path
        bar = tqdm(total=len(prompts), disable=args.no_progress, file=sys.stderr, unit="req")

        async def send(prompt: BenchPrompt) -> RequestRecord:
            async with gate:
                record = await _one(client, url, _body(args, model, prompt), prompt)
            bar.update(1)
            return record

        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(send(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started
        bar.close()
    return records, duration


def api_base(url: str) -> str:
    """The OpenAI API root of `url`: `http://host:8000` and `.../v1/` both mean `.../v1`."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def api_key(args: argparse.Namespace) -> str | None:
    """`--api-key`, else `$OPENAI_API_KEY`; None when neither is set."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def refused_message(url: str, client: httpx.AsyncClient, body: str) -> str:
    """What a 401 from `url` means, and what to change."""
    if "authorization" in client.headers:
        problem = "refused the API key"
    else:
        problem = "needs an API key and none was sent"
    return (
        f"{url} {problem} (HTTP 401: {_server_message(body)}); pass the server's key "
        f"with --api-key or set {API_KEY_ENV}"
    )


def _server_message(body: str) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200]


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    url = base_url + "/models"
    response = await client.get(url)
    if response.status_code == 401:
        raise KeyRefusedError(refused_message(url, client, response.text))
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def run(args: argparse.Namespace) -> int:
    slo = SLO(
        ttft_s=_seconds(args.slo_ttft_ms),
        tpot_s=_seconds(args.slo_tpot_ms),
        e2e_s=_seconds(args.slo_e2e_ms),
    )
    prompts = make_prompts(args)
    root = api_base(args.base_url).removesuffix("/v1")  # where /metrics is
    spec_before = read_spec_totals(root)
    try:
        records, duration = asyncio.run(run_benchmark(args, prompts))
    except KeyRefusedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPStatusError as exc:
        response = exc.response
        print(
            f"error: {response.url} answered HTTP {response.status_code}: "
            f"{_server_message(response.text)}",
            file=sys.stderr,
        )
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(records, duration, slo)
    speculation = run_totals(spec_before, read_settled(root))
    if speculation is not None:
        summary["speculation"] = speculation.as_dict()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
        if speculation is not None:
            print(format_speculation(speculation))
    if args.plot:
        from cluster.bench.plot import PlotUnavailableError, plot_run

        try:
            plot_run(records, summary, args.plot)
        except PlotUnavailableError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0 if summary["completed"] == summary["requests"] else 1


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
