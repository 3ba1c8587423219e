"""Inter-token latency with a JSON schema against without, served, one run.

    python -m benchmarks.structured_itl                     # default serve: SmolLM2, 1P1D
    python -m benchmarks.structured_itl -c deploy/configs/1p1d.yaml --prompts 12

One `disagg serve` (`-c`, else the embedded default), one client. Each of
`--prompts` chat questions is asked twice in a row, streamed at temperature
0: once plain, once with `response_format` `json_schema` (an object with a
free-text `description`, an enum and an integer, so both answers run for
tens of tokens). A request runs alone, so the gaps measure the step's cost
and not the batch's. ITL is the gap between consecutive content chunks
(one token each: the served config has no speculation), over every
request of a kind; TTFT is printed beside it (the first constrained
request also compiles its schema). The goal is ITL p50 schema / plain
at most 1.15.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serve_process import ServeProcess

GOAL = 1.15
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "color": {"type": "string", "enum": ["red", "green", "blue", "black", "white"]},
        "count": {"type": "integer"},
        "description": {"type": "string"},
    },
    "required": ["name", "color", "count", "description"],
}
TOPICS = (
    "a bicycle", "a lighthouse", "a teapot", "a mountain village", "a violin", "a desert fox",
    "a paper lantern", "a fishing boat", "a wool scarf", "a city park", "a telescope", "a bakery",
    "a river bridge", "a chess set", "a rain forest", "a kite",
)  # fmt: skip


def question(topic: str) -> str:
    return (
        f"Describe {topic} as JSON with a name, a color, a count and a description "
        "of two sentences."
    )


def stream(client: httpx.Client, body: dict[str, Any]) -> tuple[float, list[float], int]:
    """TTFT, the gaps between content chunks, and the tokens of one request."""
    start = time.perf_counter()
    arrivals: list[float] = []
    with client.stream("POST", "/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c["delta"].get("content") for c in chunk["choices"]):
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return arrivals[0] - start, gaps, len(arrivals)


def run(url: str, model: str, prompts: int, max_tokens: int) -> dict[str, dict[str, float]]:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    kinds: dict[str, dict[str, Any]] = {"plain": {}, "schema": {"response_format": fmt}}
    seen: dict[str, dict[str, list[float]]] = {
        k: {"ttft": [], "gaps": [], "tokens": []} for k in kinds
    }
    with httpx.Client(base_url=url, timeout=600) as client:
        # One unmeasured request of each kind: first-use costs stay out of the figures.
        for extra in kinds.values():
            stream(client, _body(model, question("a spoon"), max_tokens, extra))
        for topic in (TOPICS * (1 + prompts // len(TOPICS)))[:prompts]:
            for kind, extra in kinds.items():
                ttft, gaps, tokens = stream(
                    client, _body(model, question(topic), max_tokens, extra)
                )
                seen[kind]["ttft"].append(ttft)
                seen[kind]["gaps"].extend(gaps)
                seen[kind]["tokens"].append(tokens)
    return {
        kind: {
            "itl_p50_ms": 1e3 * statistics.median(v["gaps"]),
            "ttft_p50_ms": 1e3 * statistics.median(v["ttft"]),
            "tokens_mean": statistics.mean(v["tokens"]),
            "gaps": len(v["gaps"]),
        }
        for kind, v in seen.items()
    }


def _body(model: str, text: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "-c", "--config", type=Path, default=None, help="disagg config (default: the embedded one)"
    )
    parser.add_argument(
        "--prompts", type=int, default=8, help="questions, each asked plain and with the schema"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)  # fmt: skip
    with ServeProcess(args.config, ("--host", "127.0.0.1", "--port", "0")) as server:
        model = httpx.get(f"{server.url}/models", timeout=60).json()["data"][0]["id"]
        figures = run(server.url, model, args.prompts, args.max_tokens)
    print(f"model {model}, {args.prompts} prompts, max_tokens {args.max_tokens}, one at a time")
    print(f"{'kind':<8} {'ITL p50 ms':>11} {'TTFT p50 ms':>12} {'tokens':>7} {'gaps':>6}")
    for kind, f in figures.items():
        print(
            f"{kind:<8} {f['itl_p50_ms']:>11.1f} {f['ttft_p50_ms']:>12.1f} "
            f"{f['tokens_mean']:>7.1f} {f['gaps']:>6}"
        )
    ratio = figures["schema"]["itl_p50_ms"] / figures["plain"]["itl_p50_ms"]
    verdict = "met" if ratio <= GOAL else "MISSED"
    print(f"ITL p50 schema / plain: {ratio:.3f} (goal <= {GOAL}: {verdict})")


if __name__ == "__main__":
    main()
