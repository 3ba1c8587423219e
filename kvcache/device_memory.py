"""What a worker measures of its GPU: a leaf module, torch imported when called.

`kvcache.sizing` turns these readings into a cache budget; it needs no torch,
so the plan can size caches before any worker starts.

    with DeviceBytesMeter(device) as loaded:   # free memory read before ...
        model = load_model(...)
    loaded.bytes                               # ... and after, cache emptied

The delta of `torch.cuda.mem_get_info` after `empty_cache()` is what the
loading left on the device: parameters and buffers with the allocator's
rounding, copies kept by the loader, anything allocated outside the caching
allocator. Parameter sizes miss all of that. Another process allocating on
the same GPU meanwhile inflates the delta, which shrinks this instance's
cache rather than overfilling the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class DeviceMemory:
    """What a worker sees of its GPU once its weights are loaded, in bytes."""

    total: int  # the whole device
    free: int  # free on the whole device now (other instances' use is gone)
    weights: int  # what this instance holds already (its weights)


def device_memory(device: Any, weights: int) -> DeviceMemory:
    """Total and free bytes of a CUDA device now, with the `weights` bytes an
    instance has loaded there."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceMemory(int(total), int(free), weights)


def free_device_memory(device: Any) -> int:
    """Free bytes on a CUDA device now (after the weights already loaded there)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"free device memory is measured on CUDA devices only, got {device}")
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


class DeviceBytesMeter:
    """Bytes a block of code leaves on a CUDA device (see the module docstring);
    `bytes` stays None on other devices, where nothing is measured."""

    def __init__(self, device: Any) -> None:
        self.device = str(device)
        self.bytes: int | None = None
        self._free_before = 0

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def __enter__(self) -> DeviceBytesMeter:
        if self.on_cuda:
            # The first reading creates the CUDA context, so it is not counted.
            self._free_before = self._settled_free()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.on_cuda and exc_type is None:
            self.bytes = max(self._free_before - self._settled_free(), 0)

    def _settled_free(self) -> int:
        """Free bytes once the device is idle and the allocator's unused
        blocks are back with the driver."""
        import torch

        device = torch.device(self.device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return free_device_memory(device)
