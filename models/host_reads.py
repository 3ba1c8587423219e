"""Count the reads of device data back to the host while a model step runs.

On a GPU every such read (`.item()`, `int()`, `bool()`, `.tolist()`, or an op
whose output size depends on tensor values: `nonzero`, `unique`, boolean-mask
indexing) stops the host until the stream has caught up, and a step that
does one cannot be captured in a CUDA graph. The forward pass is meant to do
none: the host-side counts it branches on travel in `ForwardBatch.shape`.

    with count_host_reads(device) as reads:
        model.forward(batch, caches)
    assert reads.count == 0, reads.names

- CUDA: torch's sync debug mode ("warn") reports each synchronizing call;
  the warnings are counted (and not shown).
- CPU: nothing synchronizes, so a dispatch mode counts the ops that would on
  CUDA, and the Python methods that read a value (`item`, `tolist`,
  `__bool__`, `__int__`, `__float__`, `__index__`) count themselves, since
  on CPU some of them read memory without dispatching.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that copy a value to the host, or whose output shape needs one.
_READING_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
}
# Indexing ops that read the device when an index is a boolean mask.
_INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_CUDA_SYNC_WARNING = "synchronizing CUDA operation"


@dataclass
class HostReads:
    """What was read back: one name per read, in order."""

    names: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.names)


@contextlib.contextmanager
def count_host_reads(device: torch.device | str) -> Iterator[HostReads]:
    """Count device-to-host reads inside the block (see the module docstring)."""
    device = torch.device(device)
    reads = HostReads()
    if device.type == "cuda":
        with _cuda_sync_warnings(reads):
            yield reads
    else:
        mode = _CountingMode(reads)
        with mode, _counting_methods(reads, mode):
            yield reads


@contextlib.contextmanager
def _cuda_sync_warnings(reads: HostReads) -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    reads.names.extend(str(w.message) for w in caught if _CUDA_SYNC_WARNING in str(w.message))


class _CountingMode(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.inside_method = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        reading = func in _READING_OPS or (func in _INDEXING_OPS and _has_mask_index(args))
        if reading and not self.inside_method:
            self.reads.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


# Python entry points that read a value back. `inference_mode` lets some of
# them skip the dispatcher on CPU, so they are counted where they are called.
_READING_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _counting_methods(reads: HostReads, mode: _CountingMode) -> Iterator[None]:
    originals: dict[str, Callable[..., Any]] = {
        name: getattr(torch.Tensor, name) for name in _READING_METHODS
    }

    def counted(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any) -> Any:
            reads.names.append(f"Tensor.{name}")
            mode.inside_method += 1  # the op it dispatches is this same read
            try:
                return original(self, *args)
            finally:
                mode.inside_method -= 1

        return read

    for name in _READING_METHODS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
