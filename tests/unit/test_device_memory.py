"""kvcache.device_memory: the weights an instance loads, measured on the device
as the free memory loading took once the allocator's cache is emptied.

A fake CUDA runtime stands in for the device: loading allocates the weights
and leaves a freed temporary in the allocator's cache, which only
`empty_cache()` hands back to the driver.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvcache.device_memory import DeviceBytesMeter

MIB = 1 << 20


@dataclass
class FakeCuda:
    total: int = 1024 * MIB
    used: int = 100 * MIB  # the context and another process
    cached: int = 0  # freed by tensors, still held by the caching allocator
    synchronized: int = 0

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        return self.total - self.used - self.cached, self.total

    def empty_cache(self) -> None:
        self.cached = 0

    def synchronize(self, device: object = None) -> None:
        self.synchronized += 1

    def load(self, weights: int, temporary: int) -> None:
        self.used += weights
        self.cached += temporary


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("mem_get_info", "empty_cache", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_loaded_bytes_are_the_free_memory_loading_took(fake_cuda: FakeCuda) -> None:
    with DeviceBytesMeter("cuda:0") as loaded:
        fake_cuda.load(weights=300 * MIB, temporary=50 * MIB)
    # The freed temporary is not counted: the cache is emptied before the reading.
    assert loaded.bytes == 300 * MIB
    assert fake_cuda.synchronized == 2


def test_nothing_is_measured_off_cuda_or_after_a_failed_load(fake_cuda: FakeCuda) -> None:
    with DeviceBytesMeter("cpu") as on_cpu:
        pass
    assert on_cpu.bytes is None and fake_cuda.synchronized == 0
    meter = DeviceBytesMeter("cuda:0")
    with pytest.raises(OSError), meter:
        raise OSError("checkpoint unreadable")
    assert meter.bytes is None
