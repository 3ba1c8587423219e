"""Check a checkpoint folder before any worker starts: files, tokenizer, tensor shapes.

`resolve_plan` already parsed config.json and looked the architecture up in
the registry. This adds what a worker would otherwise find only while
loading, after Ray, placement groups and actors exist:

    weights    *.safetensors (or an index) present, each file whole
    tokenizer  tokenizer.json loads
    shapes     every tensor name and shape in the safetensors headers matches
               the model class built from config.json (on the meta device:
               no weight bytes are read and no memory is allocated)
    dtypes     every tensor loaded into a floating-point parameter is stored
               as floating point (the loader casts it to the model's dtype,
               which would turn integers into weights silently)

Each problem is one `ConfigError`, which the command line prints as one
`error:` line (exit 2).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from cluster.config.schema import ConfigError

# What safetensors headers call the dtypes a weight may be stored in.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def check_checkpoint(
    checkpoint: str | Path, model_key: str = "<config>:model", use_mtp: bool = False
) -> None:
    """Raise `ConfigError` naming what is wrong with the checkpoint at `checkpoint`.

    Missing or truncated weights, a tokenizer that does not load, an
    unsupported architecture, or tensors whose names, shapes or dtypes do
    not fit the model class all fail here, with the checkpoint loader's own
    message. `model_key` says where the model was named (`file.yaml:model`,
    `--model`) and starts the message. `use_mtp` (MTP drafting) checks the
    checkpoint's `mtp.*` tensors too, which the model loads only then.
    """
    folder = Path(checkpoint)
    try:
        _check_tokenizer(folder)
        _check_tensors(folder, use_mtp)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_key}: {exc}") from exc


def _check_tokenizer(folder: Path) -> None:
    from models.tokenizer import load_tokenizer

    try:
        load_tokenizer(folder)
    except (OSError, ValueError):
        raise
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ValueError(
            f"{folder / 'tokenizer.json'} does not load ({exc}); it is truncated or "
            "damaged: copy or write it again"
        ) from exc


def _check_tensors(folder: Path, use_mtp: bool = False) -> None:
    import dataclasses

    import torch

    from models.hf_config import load_model_config
    from models.registry import model_class_for

    config = load_model_config(folder)
    if use_mtp:
        config = dataclasses.replace(config, use_mtp=True)
    with torch.device("meta"):
        model = model_class_for(config.architecture)(config)
    # Same name mapping and error message as a real load, over shape-only tensors.
    stored: dict[str, str] = {}
    model.load_weights(_header_tensors(folder, stored))
    floats = {name for name, param in model.named_parameters() if param.is_floating_point()}
    not_float = [
        f"{name} ({dtype})"
        for name, dtype in stored.items()
        if dtype not in FLOAT_DTYPES and model.checkpoint_name(name) in floats
    ]
    if not_float:
        shown = ", ".join(not_float[:4]) + (", ..." if len(not_float) > 4 else "")
        raise ValueError(
            f"{len(not_float)} checkpoint tensor(s) are not floating point: {shown}; weights "
            f"must be stored as {', '.join(FLOAT_DTYPES)} (quantized safetensors checkpoints "
            "are not supported: use the unquantized checkpoint or a GGUF file)"
        )


def _header_tensors(folder: Path, stored: dict[str, str]) -> Iterator[tuple[str, object]]:
    """`(name, meta tensor of the stored shape)` for every tensor in the checkpoint,
    read from the safetensors headers only; `stored` gets each name's dtype."""
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
                header = shard.get_slice(name)
                stored[name] = header.get_dtype()
                yield name, torch.empty(header.get_shape(), device="meta")
