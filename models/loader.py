"""Build a model from a Hugging Face style checkpoint folder.

A folder holds `config.json` and safetensors weights, either one
`model.safetensors` (or any `*.safetensors` files) or shards listed in
`model.safetensors.index.json`. Tensors are cast to the requested dtype as they
are copied into the model, so fp32, bf16 and fp16 checkpoints all load into any
of the three.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from kvcache.dtypes import DTYPE_NAMES, torch_dtype
from models.base import CausalLM
from models.config import ModelConfig, TensorParallelShard
from models.errors import CheckpointError, ConfigError
from models.hf_config import load_model_config
from models.layers.small_products import choose_few_row_paths
from models.registry import check_tensor_parallel, model_class_for
from models.sharding import shard_config
from models.tensor_parallel import Cut, weight_cut

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    checkpoint_dir: Path | str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallelShard | None = None,
    use_mtp: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """Model in eval mode with the checkpoint's weights, and its config.

    `dtype` (`"float32"`, `"bfloat16"`, `"float16"` or the torch dtype)
    overrides the checkpoint's own; the returned config carries the dtype
    actually used, so `config.cache_spec()` matches the model.
    `tp`: build and load only this tensor-parallel rank's shard (the returned
    config is the rank's, see `models.tensor_parallel`); the rank joins the
    process's torch.distributed group in the forward pass.
    `use_mtp`: build and load the checkpoint's multi-token-prediction layers
    too (MTP drafting; their attention KV is then part of `cache_spec()`).
    """
    checkpoint_dir = Path(checkpoint_dir)
    full = load_model_config(checkpoint_dir)
    if dtype is not None:
        full = replace(full, dtype=dtype_name(dtype))
    if use_mtp:
        full = replace(full, use_mtp=True)
    tp = tp or TensorParallelShard()
    check_tensor_parallel(full, tp.size)
    config = shard_config(full, tp.rank, tp.size) if tp.size > 1 else full
    model_cls = model_class_for(config.architecture)
    # Build directly in the target dtype and device: no fp32 copy of the
    # weights ever exists, so peak memory is one model.
    with torch.device(device), _default_dtype(torch_dtype(config.dtype)):
        model: CausalLM = model_cls(config)
    model.to(dtype=torch_dtype(config.dtype))
    model.load_weights(
        iter_checkpoint_tensors(checkpoint_dir, lambda name: weight_cut(name, full, tp))
    )
    model.process_weights_after_loading()
    choose_few_row_paths(model)
    model.eval()
    return model, config


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def dtype_name(dtype: str | torch.dtype) -> str:
    """`"bfloat16"` for `torch.bfloat16` or `"bfloat16"`; `ConfigError` if unsupported."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
    return name


def checkpoint_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, shards in index order."""
    index_path = checkpoint_dir / INDEX_FILE
    if index_path.is_file():
        return _shards_from_index(index_path)
    single = checkpoint_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no weights in {checkpoint_dir}: expected {SINGLE_FILE}, {INDEX_FILE} "
            "with its shards, or other *.safetensors files"
        )
    return files


def _shards_from_index(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index_path} has no valid 'weight_map': {exc}") from exc
    shards = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    absent = [str(p.name) for p in shards if not p.is_file()]
    if absent:
        raise CheckpointError(f"{index_path} lists shards that are missing: {', '.join(absent)}")
    return shards


def iter_checkpoint_tensors(
    checkpoint_dir: Path, cut_of: Callable[[str], Cut | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of every checkpoint file, on CPU.

    `cut_of(name)`, if given, names the part of a tensor to read (a
    tensor-parallel rank's slice); only that part is read from the file.
    """
    for path in checkpoint_files(Path(checkpoint_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                cut = cut_of(name) if cut_of is not None else None
                if cut is None:
                    yield name, shard.get_tensor(name)
                else:
                    yield name, cut.read(shard.get_slice(name))
