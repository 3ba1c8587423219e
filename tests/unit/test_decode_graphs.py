"""Decode CUDA graphs: bucketing, the padded step run eagerly equals the
unpadded one, the CPU skip, and (on a GPU) replay equal to eager."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.decode_graphs import (
    CUDA_GRAPHS_ENV,
    StaticDecodeBatch,
    bucket_for,
    graph_batch_sizes,
)
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import ScheduledSequence
from kvcache.factory import create_manager
from kvcache.manager import KVCacheManager
from kvcache.tensors import CacheTensors, allocate_cache_tensors
from models.embedded.writer import write_checkpoint
from models.kernels.dispatch import FORCE_TRITON_ENV
from models.loader import load_model

BLOCK = 4
MAX_BLOCKS = 8
PROMPTS = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


class Params:
    max_tokens = 8
    temperature = 0.0
    seed = None
    logprobs = None


def test_a_step_takes_the_smallest_size_that_holds_it() -> None:
    sizes = (8, 1, 2, 4)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_captured_sizes_stop_at_the_worker_batch_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(256)[-3:] == (128, 192, 256)
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "0")
    assert graph_batch_sizes(256) == ()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graphs")
    return {
        arch: write_checkpoint(root / arch, arch, "tiny", seed=2, initializer_range=0.2)
        for arch in ("llama", "nemotron_h")
    }


def make_runner(
    checkpoint: Path, device: str = "cpu", manager_name: str = "v1"
) -> tuple[ModelRunner, KVCacheManager, CacheTensors]:
    """A runner without a sampler over a 32-block cache of `BLOCK`-token blocks."""
    model, config = load_model(checkpoint, device=device)
    spec = config.cache_spec()
    manager = create_manager(manager_name, spec, 32, BLOCK, 4)
    cache = allocate_cache_tensors(manager, device)
    runner = ModelRunner(
        model, cache.views(), manager, BLOCK, None, device=device, is_hybrid=spec.is_hybrid
    )
    return runner, manager, cache


def _prefilled_decode_step(runner: ModelRunner, manager: KVCacheManager) -> list[ScheduledSequence]:
    """Prefill `PROMPTS`, then return their first decode step (token 7 each)."""
    requests = [Request(f"r{i}", p, Params()) for i, p in enumerate(PROMPTS)]
    for r in requests:
        assert manager.allocate_slots(r.request_id, r.num_prompt_tokens + 1)
    with torch.inference_mode():
        prefill = runner.build_batch(
            [ScheduledSequence.of(r, r.num_prompt_tokens) for r in requests]
        )
        runner.model.forward(prefill, runner.caches)
    for r in requests:
        r.num_computed_tokens = r.num_prompt_tokens
        r.append_output(7)
    return [ScheduledSequence.of(r, 1) for r in requests]


@pytest.mark.parametrize("path", ["cpu-kernels", "triton-interpreted"])
def test_padded_step_matches_the_step_and_writes_only_the_null_block(
    checkpoints: dict[str, Path], path: str, kernel_switch: Callable[[str, str | None], None]
) -> None:
    if path == "triton-interpreted":
        kernel_switch(FORCE_TRITON_ENV, "1")
    runner, manager, cache = make_runner(checkpoints["llama"])
    step = runner.build_batch(_prefilled_decode_step(runner, manager))
    with torch.inference_mode():
        eager = runner.model.forward(step, runner.caches)
        before = _beyond_block_and_slot_0(runner)
        static = StaticDecodeBatch(8, MAX_BLOCKS, BLOCK, torch.device("cpu"))
        padded = runner.model.forward(static.fill(step, 8), runner.caches)
    assert padded.shape[0] == 8
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert not padded[3:].isnan().any()
    # The real rows rewrote the same K/V; padding rows wrote only into block 0.
    _assert_unchanged(before, _beyond_block_and_slot_0(runner))


def _beyond_block_and_slot_0(runner: ModelRunner) -> list[torch.Tensor]:
    """Copies of every cache block but the null block 0 and every Mamba slot but 0."""
    views = runner.caches
    return [
        *(t[1:].clone() for c in views.attention for t in (c.key_cache, c.value_cache)),
        *(t[1:].clone() for c in views.mamba for t in (c.conv_state, c.ssm_state)),
    ]


def _assert_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    """Equal up to the last bits of a matmul run at another batch size (a real
    row's K/V written again); a padding row's write would differ by far more."""
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_static_batch_refuses_what_a_graph_cannot_replay(checkpoints: dict[str, Path]) -> None:
    runner, manager, _ = make_runner(checkpoints["llama"])
    decode = _prefilled_decode_step(runner, manager)
    static = StaticDecodeBatch(2, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    assert static.fits(runner.build_batch(decode[:2]))
    assert not static.fits(runner.build_batch(decode))  # 3 sequences > 2 rows
    narrow = StaticDecodeBatch(8, 1, BLOCK, torch.device("cpu"))
    assert not narrow.fits(runner.build_batch(decode))  # tables wider than 1 block
    prompt = Request("p", [1, 2, 3], Params())
    assert manager.allocate_slots("p", 3)
    assert not static.fits(runner.build_batch([ScheduledSequence.of(prompt, 3)]))


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_prepare_on_cpu_warms_up_and_skips_graphs_with_a_log_line(
    checkpoints: dict[str, Path], arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    runner, manager, _ = make_runner(checkpoints[arch])
    decode = _prefilled_decode_step(runner, manager)
    before = _beyond_block_and_slot_0(runner)
    with caplog.at_level(logging.INFO, logger="engine.decode_graphs"):
        runner.prepare(MAX_BLOCKS, graph_batch_sizes(8))
    assert runner.graphs is None
    assert "CUDA graphs: skipped on cpu" in caplog.text
    # The warm-up steps wrote into the null block and Mamba slot 0 only.
    _assert_unchanged(before, _beyond_block_and_slot_0(runner))
    with torch.inference_mode():
        assert runner.model.forward(runner.build_batch(decode), runner.caches).isfinite().all()


@pytest.mark.gpu(1)
def test_graph_replay_gives_the_eager_hidden_states(checkpoints: dict[str, Path]) -> None:
    runner, manager, _ = make_runner(checkpoints["llama"], device="cuda")
    runner.prepare(MAX_BLOCKS, (1, 2, 4))
    assert runner.graphs is not None
    step = runner.build_batch(_prefilled_decode_step(runner, manager))
    with torch.inference_mode():
        eager = runner.model.forward(step, runner.caches).clone()
        replayed = runner.graphs.run(step)
    assert replayed is not None
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
