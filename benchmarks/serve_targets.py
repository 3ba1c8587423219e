"""The servers `benchmarks.serve_compare` measures: how each one starts.

| key | what runs | CPUs |
| --- | --- | --- |
| `vllm-agg` | one `vllm serve` | all of `--cpus`, one OpenMP thread each |
| `vllm-1p1d` | a prefill and a decode `vllm serve` joined by NixlConnector, and `benchmarks.pd_proxy` in front | one CPU each |
| `ours-agg` | `disagg serve`, every request whole on one generation instance | see `aggregated_sections` |
| `ours-1p1d-python`, `ours-1p1d-nixl` | `disagg serve`, one context + one generation instance on that transceiver | one CPU each (`cpu_affinity`), the router on either |
| `ours-offline` | no server: `benchmarks.vllm_compare --skip-vllm --engine-only`, our `EngineCore` stepped in a plain loop, every prompt at once | all of `--cpus` |

With `Setup.serving_cpus` the engines keep `cpus` to themselves: our
serving process (HTTP, router, Ray's daemons) runs on `serving_cpus` and
pins each engine instance to its CPUs of `cpus` (`cpu_affinity`); vLLM's
processes may run on both sets, its engines' OpenMP threads bound to `cpus`;
the 1P1D proxy and the client run on `serving_cpus`.

Every server is reached at `http://127.0.0.1:<port>`, gets the same batch
limits (`Setup.max_num_seqs`, `Setup.max_num_tokens`), prefix caching
(vLLM) / block reuse (ours) on or off together, and speculative decoding
(`Setup.speculative_config`, vLLM's keys: `--speculative-config` there, the
`speculative_config` block here) on or off together.

The vLLM processes load `benchmarks/vllm_site/sitecustomize.py`, which gives
NIXL agents the progress-thread delay ours use (nixl's default spins a core per
agent) and keeps vLLM's NIXL thread pinning inside each instance's own CPU
(by default both instances pin to the machine's last core).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.process_group import GroupProcess, cpu_list
from cluster.config.schema import ConfigError, config_from_dict
from engine.process_env import cpu_engine_env
from transfer.nixl.agent import DEFAULT_PROGRESS_DELAY_US, UCX_WORKER_LOCK

ROOT = Path(__file__).resolve().parents[1]
VLLM_SITE = Path(__file__).resolve().parent / "vllm_site"
DEFAULT_VLLM_PYTHON = Path("/work/vllm-venv/bin/python")
BLOCK_SIZE = 16
NIXL_SIDE_CHANNEL_OFFSET = 10  # vLLM instance i's NIXL handshake port: port + offset + i


@dataclass(frozen=True)
class Setup:
    """What every server of one comparison shares."""

    model: Path
    dtype: str
    cpus: tuple[int, ...]
    port: int
    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    prefix_caching: bool
    vllm_python: Path
    workdir: Path  # logs and generated configs
    # Our 1P1D: each instance on its own core of `cpus` (`cpu_affinity`), as vLLM's.
    pin_instances: bool = True
    # Our 1P1D's `router.first_token_at`; None: the config's default.
    first_token_at: str | None = None
    # CPUs of everything but the engines (servers' HTTP and routing, the
    # client); empty: they share `cpus` with the engines.
    serving_cpus: tuple[int, ...] = ()
    # Speculative decoding in vLLM's keys (`{"method": "ngram", ...}`); None: off.
    speculative_config: Mapping[str, Any] | None = None

    @property
    def front_cpus(self) -> tuple[int, ...]:
        """Where the serving processes and the client run."""
        return self.serving_cpus or self.cpus

    def server_cpus(self, engine_cpus: tuple[int, ...]) -> tuple[int, ...]:
        """The CPU set of a vLLM server whose engine binds to `engine_cpus`."""
        return engine_cpus + self.serving_cpus

    @property
    def layout(self) -> str:
        """Where the engines and the rest run, for the labels ('' when they share)."""
        if not self.serving_cpus:
            return ""
        return f"engines on CPU {cpu_list(self.cpus)}, the rest on {cpu_list(self.serving_cpus)}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_tokens(self) -> int:
        """Our KV cache size: every sequence of a full batch at its longest, plus a block each."""
        return self.max_num_seqs * (self.max_model_len + BLOCK_SIZE)

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"


def _threads(count: int) -> str:
    return "1 thread" if count == 1 else f"{count} threads"


def _placed(label: str, setup: Setup) -> str:
    """`label` with the setup's CPU layout added, where it has one."""
    return f"{label} [{setup.layout}]" if setup.layout else label


@dataclass
class Launch:
    """One server as processes in start order.

    ready_urls: for each process, the base URL whose `/v1/models` answers 200
        once it is up (None: nothing to wait for).
    """

    label: str
    ports: tuple[int, ...]
    processes: list[GroupProcess]
    ready_urls: list[str | None]


# ------------------------------------------------------------------- vLLM


def vllm_executable(setup: Setup) -> str:
    return str(setup.vllm_python.parent / "vllm")


def vllm_env(setup: Setup, cpus: tuple[int, ...], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_CPU_AFFINITY", "PYTHONPATH")}
    env.update(
        PYTHONPATH=str(VLLM_SITE),
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(cpus),
        OMP_NUM_THREADS=str(len(cpus)),
        VLLM_CPU_KVCACHE_SPACE="1",
        **extra,
    )
    return env


def vllm_serve_argv(setup: Setup, port: int, extra: list[str]) -> list[str]:
    caching = "--enable-prefix-caching" if setup.prefix_caching else "--no-enable-prefix-caching"
    if setup.speculative_config is not None:
        extra = ["--speculative-config", json.dumps(dict(setup.speculative_config)), *extra]
    return [
        vllm_executable(setup),
        "serve",
        str(setup.model),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", setup.dtype),
        *("--max-model-len", str(setup.max_model_len), "--max-num-seqs", str(setup.max_num_seqs)),
        *("--max-num-batched-tokens", str(setup.max_num_tokens), "--seed", "0"),
        caching,
        *extra,
    ]


def vllm_aggregated(setup: Setup) -> Launch:
    proc = GroupProcess(
        "vllm-agg",
        vllm_serve_argv(setup, setup.port, []),
        vllm_env(setup, setup.cpus),
        setup.log("vllm-agg"),
        cpus=setup.server_cpus(setup.cpus),
    )
    label = _placed(f"vLLM-CPU aggregated ({_threads(len(setup.cpus))})", setup)
    return Launch(label, (setup.port,), [proc], [setup.url])


def vllm_1p1d(setup: Setup) -> Launch:
    if len(setup.cpus) < 2:
        raise ValueError("vllm-1p1d needs two CPUs in --cpus, one per instance")
    procs: list[GroupProcess] = []
    urls: list[str | None] = []
    ports = [setup.port]
    for i, (role, kv_role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        port, side_port = setup.port + 1 + i, setup.port + NIXL_SIDE_CHANNEL_OFFSET + i
        cpus = (setup.cpus[i],)
        env = vllm_env(
            setup,
            cpus,
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
            SERVE_COMPARE_NIXL_DELAY_US=str(DEFAULT_PROGRESS_DELAY_US),
            SERVE_COMPARE_KEEP_AFFINITY="1",
            # The UCX worker lock our agents use: a mutex, not a spinlock the
            # progress thread spins on while a READ copies.
            **dict([UCX_WORKER_LOCK]),
        )
        transfer = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        argv = vllm_serve_argv(setup, port, ["--kv-transfer-config", json.dumps(transfer)])
        log = setup.log(f"vllm-{role}")
        procs.append(GroupProcess(f"vllm-{role}", argv, env, log, setup.server_cpus(cpus)))
        urls.append(f"http://127.0.0.1:{port}")
        ports += [port, side_port]
    proxy = [sys.executable, "-m", "benchmarks.pd_proxy", "--port", str(setup.port)]
    proxy += ["--prefill", str(urls[0]), "--decode", str(urls[1])]
    proxy_cpus = setup.serving_cpus or None  # else it floats, as the client does
    proxy_log = setup.log("vllm-proxy")
    procs.append(GroupProcess("vllm-proxy", proxy, dict(os.environ), proxy_log, proxy_cpus, ROOT))
    urls.append(setup.url)
    label = (
        f"vLLM-CPU 1P1D NixlConnector (1 core each, NIXL progress delay "
        f"{DEFAULT_PROGRESS_DELAY_US} us, {'='.join(UCX_WORKER_LOCK)})"
    )
    return Launch(_placed(label, setup), tuple(ports), procs, urls)


# -------------------------------------------------------------------- ours


def base_config(setup: Setup, backend: str) -> dict[str, Any]:
    speculation = setup.speculative_config
    return {
        "model": str(setup.model),
        "hostname": "127.0.0.1",
        "port": setup.port,
        "dtype": setup.dtype,
        "router": {"type": "least_loaded"},
        "cache_transceiver": {"backend": backend},
        "kv_cache": {
            # Block reuse is a V2 feature; V1 (the Llama default) otherwise.
            "manager": "v2" if setup.prefix_caching else "auto",
            "block_size": BLOCK_SIZE,
            "max_tokens": setup.kv_tokens,
            "enable_block_reuse": setup.prefix_caching,
        },
        "max_num_tokens": setup.max_num_tokens,
        "max_batch_size": setup.max_num_seqs,
        **({} if speculation is None else {"speculative_config": dict(speculation)}),
    }


def accepts(config: dict[str, Any]) -> bool:
    """True when this checkout's config schema takes `config`."""
    try:
        config_from_dict(config, source="<serve_compare>")
    except ConfigError:
        return False
    return True


def aggregated_sections(config: dict[str, Any], threads: int) -> tuple[dict[str, Any], str]:
    """`config` made aggregated-only, and how (for the table's label).

    The one place that decides what "our aggregated" means. Preferred: no
    context instance (`context_servers.num_instances: 0`) and one generation
    instance with all `threads` (`num_cpus`). Where the schema does not take
    those keys yet, the nearest equivalent: every prompt is prefilled locally
    on the generation instance (`conditional_disagg`), which runs on one
    thread while the context instance idles.
    """
    only = {"context_servers": {"num_instances": 0}}
    with_cpus = config | only | {"generation_servers": {"num_instances": 1, "num_cpus": threads}}
    if accepts(with_cpus):
        return with_cpus, f"aggregated-only ({_threads(threads)})"
    if accepts(config | only):
        return config | only, "aggregated-only (1 thread)"
    local = config | {"conditional_disagg": {"max_local_prefill_length": 1 << 20}}
    return local, "prefill local on the generation instance (1 thread; context idles)"


def ours_launch(setup: Setup, key: str, config: dict[str, Any], label: str) -> Launch:
    path = setup.workdir / f"{key}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [sys.executable, "-m", "cluster.cli", "serve", "-c", str(path)]
    proc = GroupProcess(key, argv, dict(os.environ), setup.log(key), setup.front_cpus, cwd=ROOT)
    return Launch(_placed(label, setup), (setup.port,), [proc], [setup.url])


def ours_aggregated(setup: Setup) -> Launch:
    config, how = aggregated_sections(base_config(setup, "python"), len(setup.cpus))
    if setup.serving_cpus:
        # The serving process runs on `serving_cpus`: the instance is pinned to the engines' CPUs.
        generation = config.get("generation_servers", {}) | {"cpu_affinity": list(setup.cpus)}
        config = config | {"generation_servers": generation}
        if not accepts(config):
            raise ValueError("this checkout's config has no generation_servers.cpu_affinity")
    return ours_launch(setup, "ours-agg", config, f"disagg {how}")


def pinned_1p1d(config: dict[str, Any], setup: Setup) -> tuple[dict[str, Any], str]:
    """`config` with its context instance pinned to the first CPU of the
    setup and its generation instance to the second, as vLLM's 1P1D instances
    are, and how (for the label). Unpinned when the setup says so, or where
    this checkout's schema lacks `cpu_affinity`."""
    cpus = setup.cpus
    if not setup.pin_instances or len(cpus) < 2:
        if setup.serving_cpus:  # unpinned, they would share the serving CPUs
            raise ValueError("with serving CPUs our 1P1D needs one CPU per instance in cpus")
        return config, "unpinned"
    pinned = config | {
        "context_servers": {"cpu_affinity": [cpus[0]]},
        "generation_servers": {"cpu_affinity": [cpus[1]]},
    }
    return (pinned, "1 core each") if accepts(pinned) else (config, "unpinned")


def first_token_setting(config: dict[str, Any], setup: Setup) -> tuple[dict[str, Any], str]:
    """`config` with the setup's `router.first_token_at` (if it names one), and
    the setting the server will use (for the label)."""
    if setup.first_token_at is not None:
        config = config | {"router": config["router"] | {"first_token_at": setup.first_token_at}}
    router = config_from_dict(config, source="<serve_compare>").router
    return config, router.first_token_at


def ours_1p1d(backend: str) -> Callable[[Setup], Launch]:
    def launch(setup: Setup) -> Launch:
        config, how = pinned_1p1d(base_config(setup, backend), setup)
        config, when = first_token_setting(config, setup)
        label = f"disagg 1P1D {backend} ({how}; first token at {when})"
        return ours_launch(setup, f"ours-1p1d-{backend}", config, label)

    return launch


OFFLINE = "ours-offline"
OFFLINE_LABEL = "disagg engine offline (EngineCore stepped in a loop, all prompts at once)"
OFFLINE_REPEATS = 2


def ours_offline(
    setup: Setup, num_prompts: int, input_len: int, output_len: int, out: Path
) -> GroupProcess:
    """Our engine on the served workload with nothing in front; writes `out` (JSON)."""
    argv = [sys.executable, "-m", "benchmarks.vllm_compare", "--skip-vllm", "--engine-only"]
    argv += ["--no-breakdown"]
    argv += ["--checkpoint", str(setup.model), "--dtype", setup.dtype]
    argv += ["--batch-size", str(num_prompts), "--prompt-len", str(input_len)]
    argv += ["--new-tokens", str(output_len), "--max-num-tokens", str(setup.max_num_tokens)]
    argv += ["--cpus", *(str(c) for c in setup.cpus), "--repeats", str(OFFLINE_REPEATS)]
    argv += ["--json", str(out)]
    # The environment our served CPU workers get (`engine.process_env.worker_env`).
    env = {**os.environ, **cpu_engine_env()}
    return GroupProcess(OFFLINE, argv, env, setup.log(OFFLINE), setup.cpus, ROOT)


TARGETS: dict[str, Callable[[Setup], Launch]] = {
    "vllm-agg": vllm_aggregated,
    "vllm-1p1d": vllm_1p1d,
    "ours-agg": ours_aggregated,
    "ours-1p1d-python": ours_1p1d("python"),
    "ours-1p1d-nixl": ours_1p1d("nixl"),
}
# (ours, vLLM's counterpart) for the ratio table.
PAIRS: tuple[tuple[str, str], ...] = (
    ("ours-agg", "vllm-agg"),
    ("ours-1p1d-python", "vllm-1p1d"),
    ("ours-1p1d-nixl", "vllm-1p1d"),
)
