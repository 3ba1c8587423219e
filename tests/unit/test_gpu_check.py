"""`python -m benchmarks.gpu_check --device cpu`: every part passes, without
Ray, NIXL or pydantic in the process (the GPU machine has none of them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PARTS = ("models", "engine", "kernels", "transfer", "throughput")


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
    # The engine part really preempted, and the transfer moved exact bytes.
    assert all(row["preemptions"] > 0 for row in report["parts"]["engine"])
    assert report["parts"]["transfer"][0]["exact_bytes"]
    assert [row["batch"] for row in report["parts"]["throughput"]] == [1, 4]
    assert "ALL OK" in done.stdout


def test_a_failed_part_is_a_failed_row_in_the_table() -> None:
    from benchmarks.gpu_check.report import failure_row, table

    try:
        raise RuntimeError("no CUDA device")
    except RuntimeError as error:
        row = failure_row(error)
    report = {
        "parts": {"kernels": [row]},
        "forbidden_modules": [],
        "seconds": 1.0,
        "ok": False,
    }
    text = table(report)
    assert "FAIL error=RuntimeError: no CUDA device" in text
    assert "Traceback" not in text and "Traceback" in row["traceback"]
    assert text.endswith("FAILED")
