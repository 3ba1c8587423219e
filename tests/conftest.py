"""Suite-wide pytest configuration: the `gpu(n)` marker."""

from __future__ import annotations

import os

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
