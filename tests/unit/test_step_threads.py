"""Decode-sized CPU steps on the thread count measured at startup; larger
steps on the whole team."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling import Sampler, SamplingParams
from engine.scheduler import ScheduledSequence
from engine.step_threads import (
    DECODE_SIZED_TOKENS,
    TEAM_MIN_SPEEDUP,
    StepThreads,
    calibrate,
    decode_threads_for,
)
from kvcache.factory import create_manager
from kvcache.tensors import allocate_cache_tensors
from models.cpu_threads import num_threads
from models.embedded.writer import write_checkpoint
from models.loader import load_model

BLOCK = 4


@pytest.fixture
def two_threads() -> Iterator[None]:
    with num_threads(2):
        yield


def test_the_team_decodes_only_when_it_wins_by_the_margin() -> None:
    assert decode_threads_for(one_thread_s=0.030, team_s=0.029, team=2) == 1
    assert decode_threads_for(one_thread_s=0.030, team_s=0.030 / TEAM_MIN_SPEEDUP, team=2) == 2
    assert decode_threads_for(one_thread_s=0.400, team_s=0.050, team=32) == 32


def test_num_threads_restores_the_count_when_the_work_raises() -> None:
    before = torch.get_num_threads()
    with pytest.raises(ZeroDivisionError), num_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        _ = 1 // 0
    assert torch.get_num_threads() == before


@pytest.mark.usefixtures("two_threads")
def test_only_decode_sized_steps_change_the_thread_count() -> None:
    one = StepThreads(decode_threads=1)
    with one.for_step(DECODE_SIZED_TOKENS):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with one.for_step(DECODE_SIZED_TOKENS + 1):
        assert torch.get_num_threads() == 2
    with StepThreads().for_step(1):  # not measured: the caller's count
        assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(("one_thread_s", "team_s", "chosen"), [(0.03, 0.001, 2), (0.001, 0.03, 1)])
def test_calibrate_times_both_counts_and_keeps_the_faster_one(
    one_thread_s: float, team_s: float, chosen: int
) -> None:
    seen: list[int] = []

    def step() -> None:
        seen.append(torch.get_num_threads())
        time.sleep(one_thread_s if seen[-1] == 1 else team_s)

    assert calibrate(step) == StepThreads(decode_threads=chosen)
    assert sorted(set(seen)) == [1, 2] and seen.count(1) == seen.count(2)
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_the_runner_runs_decode_steps_on_the_measured_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, config = load_model(write_checkpoint(tmp_path, "llama", "tiny"))
    manager = create_manager("v1", config.cache_spec(), 32, BLOCK)
    runner = ModelRunner(model, allocate_cache_tensors(manager).views(), manager, BLOCK, Sampler())
    runner.prepare(max_blocks_per_seq=8)
    assert runner.step_threads.decode_threads in (1, 2)
    runner.step_threads = StepThreads(decode_threads=1)
    seen: list[int] = []
    forward = model.forward

    def recording_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording_forward)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = Request("p", list(range(3, 3 + DECODE_SIZED_TOKENS + 1)), params)
    assert manager.allocate_slots("p", len(prompt.prompt_token_ids))
    runner.execute([ScheduledSequence.of(prompt, len(prompt.prompt_token_ids))])
    short = Request("s", [5, 6, 7], params)
    assert manager.allocate_slots("s", 3)
    runner.execute([ScheduledSequence.of(short, 3)])
    assert seen == [2, 1]
    assert torch.get_num_threads() == 2
