"""Check a checkpoint folder before any worker starts: files, tokenizer, tensor shapes.

`resolve_plan` already parsed config.json and looked the architecture up in
the registry. This adds what a worker would otherwise find only while
loading, after Ray, placement groups and actors exist:

    weights    *.safetensors (or an index) present
    tokenizer  tokenizer.json loads
    shapes     every tensor name and shape in the safetensors headers matches
               the model class built from config.json (on the meta device:
               no weight bytes are read and no memory is allocated)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from cluster.config.schema import ConfigError


def check_checkpoint(checkpoint: str | Path, source: str = "<config>") -> None:
    """Raise `ConfigError` naming what is wrong with the checkpoint at `checkpoint`.

    Missing weights, a tokenizer that does not load, an unsupported
    architecture, or tensors whose names or shapes do not fit the model class
    all fail here, with the checkpoint loader's own message.
    """
    from models.tokenizer import load_tokenizer

    folder = Path(checkpoint)
    try:
        load_tokenizer(folder)
        _check_tensor_shapes(folder)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}:model: {exc}") from exc


def _check_tensor_shapes(folder: Path) -> None:
    import torch

    from models.hf_config import load_model_config
    from models.registry import model_class_for

    config = load_model_config(folder)
    with torch.device("meta"):
        model = model_class_for(config.architecture)(config)
    # Same name mapping and error message as a real load, over shape-only tensors.
    model.load_weights(_header_tensors(folder))


def _header_tensors(folder: Path) -> Iterator[tuple[str, object]]:
    """`(name, meta tensor of the stored shape)` for every tensor in the checkpoint,
    read from the safetensors headers only."""
    import torch
    from safetensors import SafetensorError, safe_open

    from models.loader import checkpoint_files

    for path in checkpoint_files(folder):
        try:
            shard = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise ValueError(
                f"{path} is not a readable safetensors file ({exc}); it is truncated or "
                "damaged: copy or write it again"
            ) from exc
        with shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = shard.get_slice(name).get_shape()
                yield name, torch.empty(shape, device="meta")
