"""Suite-wide pytest configuration: the `gpu(n)` marker."""

from __future__ import annotations

import pytest


def _visible_cuda_devices() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 0
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
