"""GPU memory sizing by an instance's share of its GPU, on a faked device.

A fake GPU hands each instance, as it starts, what the worker would measure
(total, free now, its own weights); the instance then takes its weights,
activations and the cache it was sized for. One, two and four instances per
GPU must all fit, whichever order they start in, and share evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvcache.errors import CacheSizingError
from kvcache.sizing import (
    DeviceMemory,
    GpuShare,
    size_instance_cache,
    step_activation_bytes,
)
from kvcache.spec import CacheSpec

GIB = 1 << 30
SPEC = CacheSpec(num_kv_heads=8, head_dim=128, attention_layers=tuple(range(32)), dtype="bfloat16")
WEIGHTS = 16 * GIB
ACTIVATIONS = step_activation_bytes(
    num_tokens=8192,
    num_sequences=256,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    dtype_bytes=2,
)


@dataclass
class FakeGpu:
    total: int
    used: int = 0

    def start_instance(self, share: float, fraction: float) -> int:
        """Load weights, measure, size the cache, take it; the cache's bytes."""
        self.used += WEIGHTS
        memory = DeviceMemory(self.total, self.total - self.used, WEIGHTS)
        sizing = size_instance_cache(
            SPEC,
            block_size=16,
            model_len=8192,
            max_batch_size=256,
            gpu_share=GpuShare(memory, share, fraction, ACTIVATIONS),
        )
        self.used += ACTIVATIONS + sizing.total_bytes
        assert self.used <= self.total, "the instances do not fit on the GPU"
        return sizing.total_bytes


@pytest.mark.parametrize("instances", [1, 2, 4])
def test_instances_sharing_a_gpu_all_fit_and_share_evenly(instances: int) -> None:
    gpu = FakeGpu(total=141 * GIB)
    fraction = 0.9
    caches = [gpu.start_instance(1 / instances, fraction) for _ in range(instances)]
    assert gpu.used <= fraction * gpu.total
    # Every instance gets the same cache, whether it started first or last.
    assert max(caches) - min(caches) < SPEC.num_attention_layers * 2 * 16 * 8 * 128 * 2
    share = fraction * gpu.total / instances
    assert caches[0] > share - WEIGHTS - ACTIVATIONS - 2 * 16 * 8 * 128 * 2 * 32


def test_free_memory_bounds_a_share_that_others_already_took() -> None:
    # Another process holds most of the GPU: the share is not all there.
    memory = DeviceMemory(total=80 * GIB, free=30 * GIB, weights=WEIGHTS)
    budget, source = GpuShare(memory, 1.0, 0.9, ACTIVATIONS).budget()
    assert budget == 30 * GIB - ACTIVATIONS
    assert "0.9 x 1 of 81920.0 MiB" in source


def test_a_share_too_small_for_its_weights_says_what_to_change() -> None:
    memory = DeviceMemory(total=24 * GIB, free=8 * GIB, weights=WEIGHTS)
    with pytest.raises(CacheSizingError, match="0.9 x 0.5 of 24576.0 MiB.*memory_fraction"):
        size_instance_cache(
            SPEC,
            block_size=16,
            model_len=8192,
            max_batch_size=256,
            gpu_share=GpuShare(memory, 0.5, 0.9, ACTIVATIONS),
        )
