"""benchmarks.thread_counts: every count gets the same steps, on that count."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from benchmarks import thread_counts
from models.embedded.writer import write_checkpoint


def test_each_count_runs_its_decode_steps_and_prefills_on_that_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = write_checkpoint(tmp_path, "llama", "tiny")
    seen: list[int] = []
    timed_step = thread_counts._timed_step

    def recording(core, result):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        timed_step(core, result)

    monkeypatch.setattr(thread_counts, "_timed_step", recording)
    args = argparse.Namespace(dtype="float32", batch_size=2, prompt_len=12, steps=3, threads=[1, 2])
    results = thread_counts.measure(args, checkpoint)
    assert seen == [1, 2] * 3
    for result in results:
        assert len(result.step_s) == len(result.cpu_s) == len(result.sleeps) == 3
        assert len(result.prefill_s) == thread_counts.PREFILL_REPEATS
        assert all(s > 0 for s in result.step_s) and all(n >= 0 for n in result.sleeps)
    assert [r.threads for r in results] == [1, 2]
    assert "decode step p50" in results[0].line()
