"""Stream tensors into a .safetensors file, with an optional progress bar.

The format (https://github.com/huggingface/safetensors):

    [8 bytes: header length N, little-endian u64]
    [N bytes: JSON header, space-padded to a multiple of 8]
        {"__metadata__": {...}, "<name>": {"dtype": "F32", "shape": [...],
                                           "data_offsets": [begin, end]}, ...}
    [tensor bytes, back to back, in header offset order, no holes]

Tensors are written one at a time in sorted-name order, so the output is a
pure function of the input (byte-identical for identical tensors) and peak
memory stays at one tensor's bytes beyond the tensors themselves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _dtype_names() -> dict[torch.dtype, str]:
    import torch

    return {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    progress: bool = False,
    description: str | None = None,
) -> None:
    """Write `tensors` (CPU tensors, any shape) to `path` in safetensors format.

    `progress` shows a tqdm bar over the bytes written, labelled `description`
    (default: the file name). Raises `ValueError` for
    a dtype safetensors cannot store.
    """
    from tqdm import tqdm

    dtype_names = _dtype_names()
    names = sorted(tensors)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in dtype_names:
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtype_names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with (
        path.open("wb") as file,
        tqdm(
            total=offset,
            unit="B",
            unit_scale=True,
            desc=description or path.name,
            disable=not progress,
        ) as bar,
    ):
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for name in names:
            raw = _raw_bytes(tensors[name])
            file.write(raw)
            bar.update(len(raw))


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major, little-endian order (no copy if contiguous)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        # numpy has no bfloat16; reinterpret the same 2-byte words.
        flat = flat.view(torch.int16)
    return flat.numpy().data.cast("B")
