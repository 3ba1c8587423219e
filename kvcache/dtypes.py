"""The dtypes a checkpoint, its weights and its KV cache may have: the one table.

Pure Python, so config parsing and cache bookkeeping can use it without torch;
`torch_dtype` imports torch only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> bytes per element
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)


def torch_dtype(name: str) -> torch.dtype:
    """`torch.bfloat16` for `"bfloat16"`; KeyError for a name outside the table."""
    import torch

    if name not in DTYPE_BYTES:
        raise KeyError(f"dtype {name!r} is not one of {DTYPE_NAMES}")
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype
