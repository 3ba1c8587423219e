"""Engine steps on one CUDA device after the warm-up: no Triton kernel
compiles (each costs ~0.3 s in the middle of serving) and prompt attention
never takes SDPA's cuDNN backend (a plan built for every new shape)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.gpu_check.engine_setup import build_engine, checkpoint, greedy
from engine.request import Request

pytestmark = pytest.mark.gpu(1)

# (prompt lengths added before a step): a prompt alone, a prompt beside a
# decode, several beside growing decodes, padded lengths, short prompts, and
# then the decodes draining (the batch and the split count shrink).
WAVES = ([256], [256], [256], [256] * 4, [200] * 8, [77] * 3, [130, 5, 61])


@pytest.fixture
def compiles() -> Iterator[list[str]]:
    """Names of the Triton kernels compiled while the fixture is active."""
    from triton import knobs

    names: list[str] = []

    def hook(*, fn: Any, **_: Any) -> None:
        names.append(fn.name)

    knobs.runtime.jit_cache_hook = hook
    yield names
    knobs.runtime.jit_cache_hook = None


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_no_kernel_compiles_after_the_warm_up_and_no_cudnn_attention(
    arch: str, tmp_path: Path, compiles: list[str]
) -> None:
    engine = build_engine(
        checkpoint(tmp_path, arch, "small"),
        "cuda",
        "bfloat16",
        num_blocks=4096,
        max_num_tokens=4096,
        max_batch_size=64,
    )
    compiles.clear()  # the warm-up's own compiles
    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    count = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for wave in WAVES:
            for length in wave:
                prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
                engine.core.add(Request(f"r{count}", prompt, greedy(6)))
                count += 1
            engine.core.step()
        while engine.core.has_work():
            engine.core.step()
    torch.cuda.synchronize()
    assert compiles == [], f"compiled after the warm-up: {compiles}"
    ops = {event.key for event in prof.key_averages()}
    assert not {op for op in ops if "cudnn_attention" in op}, sorted(ops)
