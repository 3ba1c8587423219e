"""`benchmarks.spec_compare`'s own parts: arguments, which server each row
starts with which speculation, what the client sends, where the speculation
metrics are read, and one server's turn over a stand-in server and client.
Running the real servers is the benchmark's job."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import benchmarks.spec_compare as spec_compare
from benchmarks.process_group import GroupProcess
from benchmarks.serve_compare import Workload, bench_command
from benchmarks.serve_report import Measurement
from benchmarks.serve_targets import TARGETS, Launch, Setup, accepts, base_config, vllm_1p1d
from benchmarks.spec_compare import (
    SPECULATIVE_CONFIG,
    WARMUP_PROMPTS,
    Plan,
    anchor_dataset,
    copy_dataset,
    measure_server,
    metric_urls,
    parse_args,
    server_setup,
    spec_totals,
    target_key,
)
from benchmarks.spec_report import OURS_OFF, OURS_ON, VLLM_ON
from cluster.bench.speculation import SpecTotals
from tests.compare_setup import compare_setup, served_config
from transfer.nixl.agent import DEFAULT_PROGRESS_DELAY_US


def _plan() -> Plan:
    return Plan(
        ("copy", "anchor"), ("0.5", "1"), 8, 128, Workload(256, 64, 8, 0), 1.0, 0, 60.0, 60.0
    )


def test_defaults_and_a_short_run() -> None:
    args = parse_args([])
    assert (args.modes, args.rates, args.num_prompts) == (["agg", "1p1d"], ["0.5", "1"], 32)
    assert args.servers == [OURS_OFF, OURS_ON, VLLM_ON] and args.model == "smollm2"
    short = parse_args(
        ["--modes", "agg", "--rates", "1", "--num-prompts", "4", "--workloads", "copy"]
    )
    assert (short.modes, short.rates, short.num_prompts, short.workloads) == (
        ["agg"],
        ["1"],
        4,
        ["copy"],
    )
    with pytest.raises(SystemExit):
        parse_args(["--cpus", "0"])  # 1p1d needs a core per instance
    assert parse_args(["--cpus", "0", "--modes", "agg"]).cpus == (0,)


def test_each_server_starts_from_serve_compare_targets() -> None:
    assert target_key("agg", OURS_ON, "python") == "ours-agg"
    assert target_key("agg", VLLM_ON, "python") == "vllm-agg"
    assert target_key("1p1d", OURS_OFF, "nixl") == "ours-1p1d-nixl"
    assert target_key("1p1d", VLLM_ON, "python") == "vllm-1p1d"
    assert all(
        target_key(m, s, "python") in TARGETS for m in ("agg", "1p1d") for s in (OURS_ON, VLLM_ON)
    )


def test_speculation_on_both_sides_together(tmp_path: Path) -> None:
    off, on = (server_setup(compare_setup(tmp_path), s) for s in (OURS_OFF, OURS_ON))
    assert off.speculative_config is None and "speculative_config" not in base_config(off, "python")
    ours = served_config(TARGETS["ours-agg"](on).processes[0].argv)
    assert ours["speculative_config"] == SPECULATIVE_CONFIG and accepts(ours)
    vllm = server_setup(compare_setup(tmp_path), VLLM_ON)
    (proc,) = TARGETS["vllm-agg"](vllm).processes
    flag = proc.argv.index("--speculative-config")
    assert json.loads(proc.argv[flag + 1]) == SPECULATIVE_CONFIG
    assert "--speculative-config" not in TARGETS["vllm-agg"](off).processes[0].argv


def test_1p1d_pins_each_instance_and_gives_vllm_the_nixl_delay(tmp_path: Path) -> None:
    on = server_setup(compare_setup(tmp_path), OURS_ON)
    ours = TARGETS[target_key("1p1d", OURS_ON, "python")](on)
    config = served_config(ours.processes[0].argv)
    assert config["speculative_config"] == SPECULATIVE_CONFIG and accepts(config)
    assert config["context_servers"] == {"cpu_affinity": [0]}
    assert config["generation_servers"] == {"cpu_affinity": [1]}
    assert "1 core each" in ours.label
    vllm = TARGETS[target_key("1p1d", VLLM_ON, "python")](server_setup(on, VLLM_ON))
    prefill, decode, _proxy = vllm.processes
    for cpu, instance in enumerate((prefill, decode)):
        assert instance.argv[:3] == ["taskset", "-c", str(cpu)]
        assert instance.env["VLLM_CPU_OMP_THREADS_BIND"] == str(cpu)
        assert instance.env["SERVE_COMPARE_NIXL_DELAY_US"] == str(DEFAULT_PROGRESS_DELAY_US)
        assert "--speculative-config" in instance.argv and "--kv-transfer-config" in instance.argv
    assert f"1 core each, NIXL progress delay {DEFAULT_PROGRESS_DELAY_US} us" in vllm.label


def test_the_copy_client_sends_chat_prompts_greedy(tmp_path: Path) -> None:
    setup, plan = compare_setup(tmp_path), _plan()
    args = copy_dataset(setup, plan, 8, seed=2)
    argv = bench_command(setup, "m", plan.anchor, "1", 2, tmp_path / "r.json", args)
    joined = " ".join(argv)
    for part in (
        "--backend openai-chat",
        "--endpoint /v1/chat/completions",
        "--dataset-name sharegpt",
        "--sharegpt-output-len 128",
        "--temperature 0",
        "--num-prompts 8",
        "--request-rate 1 --seed 2",
        "--percentile-metrics ttft,tpot,itl",
    ):
        assert part in joined
    assert "--ignore-eos" not in argv and "random" not in argv
    path = Path(argv[argv.index("--dataset-path") + 1])
    assert len(json.loads(path.read_text())) == 8


def test_the_anchor_is_serve_compares_random_workload_sampled(tmp_path: Path) -> None:
    argv = " ".join(anchor_dataset(_plan()))
    assert (
        "--dataset-name random --random-input-len 256 --random-output-len 64 --ignore-eos" in argv
    )
    assert argv.endswith("--temperature 1.0")  # sampled: greedy loops, and drafts match a loop


def test_metrics_are_summed_over_every_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = vllm_1p1d(compare_setup(tmp_path))
    urls = metric_urls(launch)
    assert urls == ["http://127.0.0.1:18101", "http://127.0.0.1:18102", "http://127.0.0.1:18100"]
    reads = {urls[1]: SpecTotals(30, 20, 10), urls[2]: SpecTotals(3, 2, 1)}
    monkeypatch.setattr(spec_compare, "read_spec_totals", lambda url: reads.get(url))
    assert spec_totals(urls, settled=False) == SpecTotals(33, 22, 11)
    assert spec_totals(urls[:1], settled=False) is None  # the prefill instance drafts nothing
    assert metric_urls(TARGETS["ours-agg"](compare_setup(tmp_path))) == ["http://127.0.0.1:18100"]


def _sleeper(tmp_path: Path) -> Launch:
    proc = GroupProcess(
        "server", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "s.log"
    )
    return Launch("a sleeper", (), [proc], [None])  # nothing to wait for, no /metrics


def test_a_turn_warms_up_each_workload_and_a_failure_fails_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = _sleeper(tmp_path)
    monkeypatch.setitem(spec_compare.TARGETS, "ours-agg", lambda setup: launch)
    sent: list[tuple[str, int, str, int, str]] = []

    def client(
        _: Setup, workload: Workload, rate: str, seed: int, name: str, __: float, dataset: list[str]
    ) -> Measurement:
        assert launch.processes[0].alive()
        backend = dataset[dataset.index("--backend") + 1]
        sent.append((name, workload.num_prompts, rate, seed, backend))
        if name == "agg-ours-on-anchor-rate1":
            raise RuntimeError("vllm bench serve exited 1\nsee its log")
        return Measurement(10.0, 1.0, 2.0, 3.0, 4.0, workload.num_prompts, 0)

    monkeypatch.setattr(spec_compare, "run_client", client)
    plan = dataclasses.replace(_plan(), num_prompts=4, anchor=Workload(256, 64, 4, 0))
    rows = measure_server("agg", OURS_ON, compare_setup(tmp_path), plan, "python")
    assert sent == [
        ("agg-ours-on-copy-warmup", WARMUP_PROMPTS, "inf", 0, "openai-chat"),
        ("agg-ours-on-anchor-warmup", WARMUP_PROMPTS, "inf", 0, "openai"),
        ("agg-ours-on-copy-rate0.5", 4, "0.5", 1, "openai-chat"),
        ("agg-ours-on-copy-rate1", 4, "1", 2, "openai-chat"),
        ("agg-ours-on-anchor-rate0.5", 4, "0.5", 1, "openai"),
        ("agg-ours-on-anchor-rate1", 4, "1", 2, "openai"),
    ]
    assert [(r.workload, r.rate, r.result is not None) for r in rows] == [
        ("copy", "0.5", True),
        ("copy", "1", True),
        ("anchor", "0.5", True),
        ("anchor", "1", False),
    ]
    assert rows[-1].error == "vllm bench serve exited 1"
    assert {r.label for r in rows} == {"a sleeper; n-gram speculation"}
    assert not launch.processes[0].alive()
