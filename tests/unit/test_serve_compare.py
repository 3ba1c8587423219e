"""The served comparison's own parts: arguments, configs, process groups and
port checks (its tables: test_serve_report.py). Running vLLM is the
benchmark's job, not the suite's."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.pd_proxy import decode_request, prefill_request
from benchmarks.process_group import (
    GroupProcess,
    PortBusy,
    check_ports_free,
    cpu_by_name,
    descendants,
    listener_pid,
    tree_cpu_seconds,
)
from benchmarks.serve_compare import (
    bench_command,
    children_cpu_seconds,
    failure_reason,
    format_cpu,
    measure_each,
    parse_args,
    rate_seeds,
    running,
    serve_runs,
)
from benchmarks.serve_targets import (
    OFFLINE,
    Launch,
    accepts,
    aggregated_sections,
    base_config,
    first_token_setting,
    ours_1p1d,
    ours_aggregated,
    ours_offline,
    pinned_1p1d,
    vllm_1p1d,
    vllm_aggregated,
)
from cluster.config.schema import RouterConfig
from tests.compare_setup import compare_setup, served_config


def test_defaults_quick_and_rates() -> None:
    assert parse_args([]).rates == ["2", "8", "inf"]
    servers = parse_args([]).servers
    assert servers.index(OFFLINE) == servers.index("ours-agg") + 1
    assert parse_args(["--quick"]).rates == ["8", "inf"]
    args = parse_args(["--rates", "0.5", "Inf", "--servers", "ours-agg", "vllm-agg"])
    assert args.rates == ["0.5", "inf"] and args.servers == ["ours-agg", "vllm-agg"]
    assert parse_args(["--cpus", "2,5"]).cpus == (2, 5)


@pytest.mark.parametrize(
    "argv",
    [
        ["--rates", "0"],
        ["--rates", "fast"],
        ["--cpus", "0,0"],
        ["--servers", "tgi"],
        ["--cpus", "0,1", "--serving-cpus", "1"],  # the engines need CPUs of their own
        ["--serving-cpus", "2", "--unpinned"],
        ["--cpus", "0", "--serving-cpus", "1"],  # the default servers include the 1P1D ones
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def test_each_rate_has_its_own_seed_and_every_server_the_same() -> None:
    seeds = rate_seeds(["2", "8", "inf"], base_seed=0)
    assert len({seed for _, seed in seeds}) == 3
    assert seeds == rate_seeds(["2", "8", "inf"], base_seed=0)
    assert 0 not in {seed for _, seed in seeds}  # seed 0 is the warm-up's


def test_serving_cpus_are_parsed_and_leave_one_cpu_engines_to_aggregated_servers() -> None:
    args = parse_args(["--cpus", "0", "--serving-cpus", "1", "--servers", "ours-agg", "vllm-agg"])
    assert args.cpus == (0,) and args.serving_cpus == (1,)
    assert parse_args([]).serving_cpus == ()


def test_serving_cpus_keep_the_engines_cpus_to_themselves(tmp_path: Path) -> None:
    split = compare_setup(tmp_path, cpus=(0,), serving_cpus=(1,))
    ours = ours_aggregated(split)
    (proc,) = ours.processes
    assert proc.argv[:3] == ["taskset", "-c", "1"]  # the serving process and Ray's daemons
    config = served_config(proc.argv)
    assert config["generation_servers"]["cpu_affinity"] == [0] and accepts(config)
    assert "engines on CPU 0, the rest on 1" in ours.label
    (vllm,) = vllm_aggregated(split).processes
    assert vllm.argv[:3] == ["taskset", "-c", "0,1"]
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and vllm.env["OMP_NUM_THREADS"] == "1"
    assert ours_offline(split, 64, 256, 64, tmp_path / "o.json").argv[:3] == ["taskset", "-c", "0"]
    client = bench_command(split, "m", _workload(), "inf", 7, tmp_path / "r.json")
    assert client[:3] == ["taskset", "-c", "1"] and client[3].endswith("vllm")
    shared = ours_aggregated(compare_setup(tmp_path))
    assert shared.processes[0].argv[:3] == ["taskset", "-c", "0,1"] and "[" not in shared.label
    assert "cpu_affinity" not in served_config(shared.processes[0].argv)["generation_servers"]


def test_serving_cpus_put_each_1p1d_instance_on_its_own_engine_cpu(tmp_path: Path) -> None:
    split = compare_setup(tmp_path, serving_cpus=(2,))
    (proc,) = ours_1p1d("python")(split).processes
    config = served_config(proc.argv)
    assert proc.argv[:3] == ["taskset", "-c", "2"]
    assert config["context_servers"] == {"cpu_affinity": [0]}
    assert config["generation_servers"] == {"cpu_affinity": [1]}
    prefill, decode, proxy = vllm_1p1d(split).processes
    assert prefill.argv[:3] == ["taskset", "-c", "0,2"] and decode.argv[:3] == [
        "taskset",
        "-c",
        "1,2",
    ]
    assert decode.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and proxy.argv[:3] == [
        "taskset",
        "-c",
        "2",
    ]
    assert vllm_1p1d(compare_setup(tmp_path)).processes[2].argv[0] != "taskset"
    with pytest.raises(ValueError, match="one CPU per instance"):
        pinned_1p1d(base_config(split, "python"), dataclasses.replace(split, pin_instances=False))


def _workload() -> Any:
    from benchmarks.serve_compare import Workload

    return Workload(256, 64, 64, 0)


def test_client_command_carries_the_workload(tmp_path: Path) -> None:
    from benchmarks.serve_compare import Workload

    out = tmp_path / "r.json"
    argv = bench_command(compare_setup(tmp_path), "m", Workload(256, 64, 64, 0), "inf", 7, out)
    joined = " ".join(argv)
    assert argv[0] == str(tmp_path / "venv" / "bin" / "vllm")
    for part in ("--random-input-len 256", "--random-output-len 64", "--num-prompts 64"):
        assert part in joined
    assert "--ignore-eos" in argv and "--request-rate inf" in joined and "--seed 7" in joined
    assert f"--result-filename {out.name}" in joined


def test_offline_command_runs_the_served_workload(tmp_path: Path) -> None:
    proc = ours_offline(compare_setup(tmp_path), 64, 256, 32, tmp_path / "o.json")
    joined = " ".join(proc.argv)
    assert proc.argv[:3] == ["taskset", "-c", "0,1"] and "benchmarks.vllm_compare" in joined
    assert "--skip-vllm" in proc.argv and "--engine-only" in proc.argv
    for part in ("--batch-size 64", "--prompt-len 256", "--new-tokens 32", "--cpus 0 1"):
        assert part in joined
    assert "--max-num-tokens 2048" in joined and f"--json {tmp_path / 'o.json'}" in joined


def test_our_configs_validate_and_aggregated_says_how(tmp_path: Path) -> None:
    setup = compare_setup(tmp_path)
    for backend in ("python", "nixl"):
        assert accepts(base_config(setup, backend))
    config, how = aggregated_sections(base_config(setup, "python"), threads=2)
    assert accepts(config)
    no_context = base_config(setup, "python") | {"context_servers": {"num_instances": 0}}
    if accepts(no_context):
        assert config["context_servers"] == {"num_instances": 0} and "aggregated-only" in how
    else:
        assert config["conditional_disagg"]["max_local_prefill_length"] >= setup.max_model_len
        assert "prefill local" in how


def test_our_1p1d_pins_one_core_per_instance_unless_told_not_to(tmp_path: Path) -> None:
    setup = compare_setup(tmp_path)
    config, how = pinned_1p1d(base_config(setup, "python"), setup)
    assert accepts(config) and how == "1 core each"
    assert config["context_servers"] == {"cpu_affinity": [0]}
    assert config["generation_servers"] == {"cpu_affinity": [1]}
    unpinned = dataclasses.replace(setup, pin_instances=False)
    config, how = pinned_1p1d(base_config(unpinned, "python"), unpinned)
    assert "context_servers" not in config and how == "unpinned"


def test_our_1p1d_says_when_its_router_sends_the_first_token(tmp_path: Path) -> None:
    setup = compare_setup(tmp_path)
    config, when = first_token_setting(base_config(setup, "python"), setup)
    assert when == RouterConfig().first_token_at and "first_token_at" not in config["router"]
    chosen = dataclasses.replace(setup, first_token_at="prefill")
    config, when = first_token_setting(base_config(chosen, "python"), chosen)
    assert when == "prefill" and config["router"]["first_token_at"] == "prefill"
    assert parse_args(["--first-token-at", "admission"]).first_token_at == "admission"


def test_block_reuse_follows_prefix_caching(tmp_path: Path) -> None:
    kv = base_config(compare_setup(tmp_path, prefix_caching=True), "nixl")["kv_cache"]
    assert kv["enable_block_reuse"] and kv["manager"] == "v2"
    assert not base_config(compare_setup(tmp_path), "nixl")["kv_cache"]["enable_block_reuse"]


def test_proxy_splits_a_request_into_prefill_and_decode() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True}
    body |= {"stream_options": {"include_usage": True}, "ignore_eos": True}
    prefill = prefill_request(body)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill and prefill["ignore_eos"] is True
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    params = {"remote_engine_id": "e", "remote_block_ids": [1, 2]}
    decode = decode_request(body, {"kv_transfer_params": params})
    assert decode["kv_transfer_params"] == params and decode["max_tokens"] == 64
    assert decode_request(body, {}) == body


def test_a_held_port_is_reported_with_its_owner() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert listener_pid(port) is not None
        with pytest.raises(PortBusy, match=f"port {port} is in use by pid"):
            check_ports_free([port], wait_s=0.5)
    check_ports_free([port], wait_s=0.5)


def test_stop_ends_descendants_that_left_the_group(tmp_path: Path) -> None:
    # The child starts a grandchild in a session of its own, as Ray's helpers do.
    script = "import subprocess, time; subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"
    proc = GroupProcess("t", [sys.executable, "-c", script], {}, tmp_path / "t.log")
    proc.start()
    assert proc.process is not None
    deadline = time.monotonic() + 10
    while not descendants(proc.process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchildren = descendants(proc.process.pid)
    assert grandchildren
    proc.stop(grace_s=5)
    assert proc.process.poll() is not None
    for pid in grandchildren:
        assert not _running(pid)


def _running(pid: int) -> bool:
    stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return stat.returncode == 0 and not stat.stdout.strip().startswith("Z")


def test_children_cpu_seconds_count_a_finished_client() -> None:
    before = children_cpu_seconds()
    spin = "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True, timeout=60)
    assert children_cpu_seconds() - before >= 0.2


def test_server_cpu_is_split_by_process_name_across_the_tree(tmp_path: Path) -> None:
    # A leader that idles and a grandchild (its own session, as Ray's helpers)
    # that burns 0.3 CPU-s once told to: only the grandchild's name gains.
    burn = (
        "import os, sys, time\n"
        "open('/proc/self/comm', 'w').write('burner')\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "time.sleep(300)"
    )
    go = tmp_path / "go"
    script = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {burn!r}, {str(go)!r}], start_new_session=True); "
        "time.sleep(300)"
    )
    proc = GroupProcess("t", [sys.executable, "-c", script], {}, tmp_path / "t.log")
    proc.start()
    assert proc.process is not None
    try:
        deadline = time.monotonic() + 10
        while not descendants(proc.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        before = tree_cpu_seconds([proc.process.pid])
        assert len(before) == 2
        go.touch()
        time.sleep(1.0)
        spent = cpu_by_name(before, tree_cpu_seconds([proc.process.pid]))
    finally:
        proc.stop(grace_s=5)
    assert list(spent) == ["burner", "python"]
    assert spent["burner"] >= 0.25 and spent["python"] < 0.1
    assert format_cpu(spent).startswith(f"server {sum(spent.values()):.2f} (")


def _sleepers(tmp_path: Path, *names: str) -> Launch:
    procs = [
        GroupProcess(
            name,
            [sys.executable, "-c", "import time; time.sleep(60)"],
            {},
            tmp_path / f"{name}.log",
        )
        for name in names
    ]
    return Launch("sleepers", (), procs, [None] * len(procs))  # nothing to wait for


def test_running_stops_every_process_when_a_run_fails(tmp_path: Path) -> None:
    launch = _sleepers(tmp_path, "server", "proxy")
    procs = launch.processes
    with pytest.raises(RuntimeError, match="client failed"), running(launch, 5.0):
        assert all(p.alive() for p in procs)
        raise RuntimeError("client failed")
    assert not any(p.alive() for p in procs)


def test_a_turn_keeps_its_measured_rows_and_fails_the_rest(tmp_path: Path) -> None:
    launch = _sleepers(tmp_path, "server")
    done: list[str] = []

    def measure(rate: str) -> str:
        assert launch.processes[0].alive()
        if rate == "8":
            raise httpx.ReadTimeout("")  # no message: the reason is its type
        done.append(rate)
        return f"{rate} ok"

    rows = serve_runs(
        launch, 5.0, lambda: done.append("warm"), ["2", "8", "inf"], measure, "{} {}".format
    )
    assert done == ["warm", "2"]
    assert rows == ["2 ok", "8 ReadTimeout", "inf ReadTimeout"]
    assert not launch.processes[0].alive()
    assert failure_reason(RuntimeError("x" * 200 + "\nmore")) == "x" * 120


def test_a_held_port_ends_the_benchmark_and_ctrl_c_keeps_the_rows(tmp_path: Path) -> None:
    def busy() -> list[str]:
        raise PortBusy("port 1 is in use by pid 2")

    def interrupted() -> list[str]:
        raise KeyboardInterrupt

    def turn(name: str) -> Callable[[], list[str]]:
        return lambda: [name]

    printed: list[list[str]] = []

    def table(rows: list[str]) -> str:
        printed.append(list(rows))
        return "the table"

    assert measure_each([turn("a"), turn("b")], table) == (["a", "b"], None)
    assert printed == []  # the caller prints the finished rows
    assert measure_each([turn("a"), busy, turn("never")], table) == (["a"], 1)
    assert measure_each([turn("a"), interrupted, turn("never")], table) == (["a"], 130)
    assert printed == [["a"], ["a"]]  # the rows so far, printed where it stopped

    def held() -> None:
        raise PortBusy("port 1 is in use by pid 2")

    launch = _sleepers(tmp_path, "s")
    with pytest.raises(PortBusy):
        serve_runs(launch, 5.0, held, ["1"], lambda r: r, "{} {}".format)
    assert not launch.processes[0].alive()


def test_model_nemotron_h_is_a_hybrid_without_moe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.serve_compare as serve_compare

    monkeypatch.setattr(serve_compare, "NEMOTRON_H_MODEL", tmp_path / "hybrid")
    folder = serve_compare.resolve_model("nemotron-h")
    config = json.loads((folder / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "M-M*-M-M*-M"
    assert "moe" not in config["layers_block_type"] and config["hidden_size"] == 512
