"""An n = 4 request against four n = 1 requests, served: what was prefilled and moved.

    python -m benchmarks.n_prefill                          # default serve: SmolLM2, 1P1D
    python -m benchmarks.n_prefill -c deploy/configs/1p1d.yaml --prompt-words 400

One `disagg serve` (`-c`, else the embedded default). The same prompt (a
`--prompt-words` passage, fresh per run so no cache holds it) is answered
as one request with n = 4 and, with another passage of the same length, as
four requests with n = 1, sampled with seeds. From `/metrics` before and
after each: the prefills dispatched to context workers
(`disagg_routed_requests_total{phase="context"}`), the prompt tokens
counted (`disagg_prompt_tokens_total`) and the cache bytes moved
(`disagg_kv_transfer_bytes_total`), with each run's wall time. With block
reuse off, four n = 1 requests prefill four times and move four caches;
n = 4 prefills once and moves once.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import httpx

from benchmarks.serve_process import ServeProcess

METRICS = (
    ("prefills", "disagg_routed_requests_total", 'phase="context"'),
    ("prompt tokens", "disagg_prompt_tokens_total", ""),
    ("bytes moved", "disagg_kv_transfer_bytes_total", ""),
)
WORDS = [
    "river",
    "stone",
    "light",
    "morning",
    "garden",
    "window",
    "bread",
    "letter",
    "quiet",
    "market",
    "bridge",
    "winter",
    "harbor",
    "paper",
    "lantern",
    "forest",
    "violin",
    "orchard",
    "candle",
    "meadow",
]


def totals(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for label, name, selector in METRICS:
        series = re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
        out[label] = sum(float(value) for labels, value in series if selector in labels)
    return out


def passage(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ". Continue:"


def measure(
    api: httpx.Client, metrics: httpx.Client, model: str, bodies: list[dict]
) -> tuple[dict[str, float], float, int]:
    before = totals(metrics)
    start = time.perf_counter()
    choices = 0
    for body in bodies:
        reply = api.post("/completions", json={"model": model, **body})
        reply.raise_for_status()
        choices += len(reply.json()["choices"])
    wall = time.perf_counter() - start
    after = totals(metrics)
    return {k: after[k] - before[k] for k in before}, wall, choices


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "-c", "--config", type=Path, default=None, help="disagg config (default: the embedded one)"
    )
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)  # fmt: skip
    seed = random.randrange(1 << 30)
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.8}
    with ServeProcess(args.config, ("--host", "127.0.0.1", "--port", "0")) as server:
        root = server.url.removesuffix("/v1")
        with (
            httpx.Client(base_url=server.url, timeout=600) as api,
            httpx.Client(base_url=root, timeout=60) as metrics,
        ):
            model = api.get("/models").json()["data"][0]["id"]
            api.post("/completions", json={"model": model, "prompt": "warm up", "max_tokens": 2})
            runs = {
                "n=4": [
                    {"prompt": passage(seed, args.prompt_words), "n": 4, "seed": 1, **sampling}
                ],
                "4 x n=1": [
                    {"prompt": passage(seed + 1, args.prompt_words), "seed": i, **sampling}
                    for i in range(4)
                ],
            }
            results = {name: measure(api, metrics, model, bodies) for name, bodies in runs.items()}
    print(f"model {model}, prompt of {args.prompt_words} words, {args.max_tokens} tokens a choice")
    header = "".join(f"{label:>15}" for label, _, _ in METRICS)
    print(f"{'run':<9}{'choices':>8}{header}{'wall s':>9}")
    for name, (delta, wall, choices) in results.items():
        cells = "".join(f"{delta[label]:>15,.0f}" for label, _, _ in METRICS)
        print(f"{name:<9}{choices:>8}{cells}{wall:>9.2f}")
    one, four = results["n=4"][0], results["4 x n=1"][0]
    for label, _, _ in METRICS:
        if one[label]:
            print(f"{label}: 4 x n=1 / n=4 = {four[label] / one[label]:.2f}")


if __name__ == "__main__":
    main()
