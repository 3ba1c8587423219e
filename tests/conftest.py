"""Suite-wide pytest configuration: the `gpu(n)` marker, and `kernel_switch`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter. The variable must be
# set before the first `import triton`, and conftest is imported before any
# test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _visible_cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = _visible_cuda_devices()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.args[0]) if marker.args else 1
        if available < needed:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {needed} CUDA device(s), {available} visible")
            )


@pytest.fixture
def kernel_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str | None], None]]:
    """`kernel_switch(name, value)` sets a kernel switch of `models.kernels`
    (`DISAGG_FORCE_TRITON`, `DISAGG_CPU_KERNELS`; None unsets it) for this
    test. The kernels read them once per process, so each change is read
    again, and the process's own values after the test."""
    from models.kernels.dispatch import reread_kernel_switches

    def switch(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        reread_kernel_switches()

    yield switch
    reread_kernel_switches()  # read at the next use, once monkeypatch restored them
