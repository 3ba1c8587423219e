"""`python -m benchmarks.gpu_check --device cpu`: every part passes, without
Ray, NIXL or pydantic in the process (the GPU machine has none of them), and
lists every check the GPU run makes, each marked `cpu-run` or `needs-cuda`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PARTS = ("models", "engine", "kernels", "transfer", "sizing", "throughput")


def test_cpu_smoke_run_passes_every_part_without_ray_nixl_or_pydantic(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--device",
            "cpu",
            "--out",
            str(report_path),
            "--checkpoints",
            str(tmp_path / "checkpoints"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["forbidden_modules"] == []
    assert tuple(report["parts"]) == PARTS
    failed = [row for rows in report["parts"].values() for row in rows if not row["ok"]]
    assert not failed, failed
    parts = report["parts"]
    rows = [row for part in parts.values() for row in part]
    assert {row["run"] for row in rows} == {"cpu-run", "needs-cuda"}
    # The engine part really preempted, and the transfers moved exact bytes.
    assert all(row["preemptions"] > 0 for row in parts["engine"] if row["run"] == "cpu-run")
    assert [row["exact_bytes"] for row in parts["transfer"]] == [True, True]
    assert "head-sliced" in parts["transfer"][1]["check"]
    assert [row["batch"] for row in parts["throughput"]] == [1, 4]
    # What only a GPU runs is listed, not dropped: graph replays against
    # transformers and in the engine, compiled (bf16) kernels, the shared GPU.
    needs = {part: [r for r in rows_ if r["run"] == "needs-cuda"] for part, rows_ in parts.items()}
    assert {(r["arch"], r["dtype"]) for r in needs["models"]} == {
        ("llama", "float32"),
        ("llama", "bfloat16"),
    }
    assert [r["arch"] for r in needs["engine"]] == ["llama"]
    assert {r["dtype"] for r in needs["kernels"]} == {"float32", "bfloat16"}
    assert all(r["mode"] == "interpreted" for r in parts["kernels"] if r["run"] == "cpu-run")
    assert len(needs["sizing"]) == 1 and parts["sizing"][0]["run"] == "cpu-run"
    for row in rows:
        assert f"[{row['run']}]" in done.stdout
    assert "checks need CUDA" in done.stdout and "ALL OK" in done.stdout


def test_a_failed_part_is_a_failed_row_in_the_table() -> None:
    from benchmarks.gpu_check.report import failure_row, table

    try:
        raise RuntimeError("no CUDA device")
    except RuntimeError as error:
        row = failure_row(error)
    row["run"] = "cuda"
    report = {
        "parts": {"kernels": [row]},
        "forbidden_modules": [],
        "seconds": 1.0,
        "ok": False,
    }
    text = table(report)
    assert "FAIL [cuda] error=RuntimeError: no CUDA device" in text
    assert "Traceback" not in text and "Traceback" in row["traceback"]
    assert text.endswith("FAILED")


def test_a_check_that_needs_cuda_is_listed_not_failed() -> None:
    from benchmarks.gpu_check.report import mark_run, needs_cuda, table

    rows = mark_run([{"kernel": "paged_attention_decode", "ok": True}, needs_cuda("graphs")], "cpu")
    report = {"parts": {"kernels": rows}, "forbidden_modules": [], "seconds": 1.0, "ok": True}
    text = table(report)
    assert "ok   [cpu-run] kernel=paged_attention_decode" in text
    assert "ok   [needs-cuda] check=graphs" in text
    assert "1 checks need CUDA" in text


def test_a_sizing_instance_runs_its_steps(tmp_path: Path) -> None:
    """The steps each GPU sizing instance runs (a step at the token budget,
    then sampled decode steps of the whole batch), here on CPU."""
    from benchmarks.gpu_check import sizing
    from benchmarks.gpu_check.engine_setup import build_engine, checkpoint

    engine = build_engine(checkpoint(tmp_path, "llama", "tiny"), "cpu", "float32", num_blocks=64)
    replays = sizing.run_steps(engine.runner, engine.manager, 16, 10_000)
    assert replays == 0  # no graphs on CPU
    assert engine.manager.num_free_blocks < engine.manager.num_usable_blocks
