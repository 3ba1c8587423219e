"""A GGUF file as a cached checkpoint folder, made once per file content.

    <cache>/<sha256 of the file>-v<FORMAT>/<file stem>/
        config.json, generation_config.json     from the GGUF metadata
        model.safetensors (or shards + index)   dequantized tensors, Hugging Face names
        tokenizer.json, tokenizer_config.json,  transformers' GGUF tokenizer conversion
        chat_template.jinja                     (the file's chat template)

`<cache>` is `$DISAGG_GGUF_CACHE`, else `~/.cache/disagg/gguf`. The folder is
written under a temporary name and renamed into place in one step, so a
folder under its final name is always complete: an interrupted conversion
leaves only a temporary folder, removed by the next conversion of that file.
The folder is named after the file's stem so the served model is named after
the file, not the hash; copies of one file under other names share the entry.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from gguf import GGUFReader, ReaderTensor
from tqdm import tqdm

from models.checkpoint_manifest import file_sha256
from models.embedded.safetensors_file import write_safetensors
from models.errors import GGUFError
from models.gguf.metadata import GGUFMetadata, hf_config
from models.gguf.tensors import check_tensor_types, hf_name, output_dtype, to_torch
from models.staging import remove_abandoned, staging_path

CACHE_ENV = "DISAGG_GGUF_CACHE"
# Bump when the folder's contents change for the same GGUF file.
FORMAT_VERSION = 1
# Upper bound of one safetensors shard, so dequantizing holds one shard in memory.
SHARD_BYTES = 2 << 30


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "disagg" / "gguf")


def cached_checkpoint(
    gguf_file: Path | str, cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """The checkpoint folder for `gguf_file`, converted first if it is not cached yet.

    Raises `GGUFError` for a file this project cannot serve (architecture,
    tensor type, unknown tensor), before anything is written.
    """
    source = Path(gguf_file)
    root = cache_dir if cache_dir is not None else default_cache_dir()
    entry = root / f"{file_sha256(source)}-v{FORMAT_VERSION}"
    folder = entry / source.stem
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(entry)
    staging = staging_path(entry)
    try:
        _convert(source, staging / source.stem, progress)
        entry.mkdir(exist_ok=True)  # shared by copies of the file under other names
        try:
            (staging / source.stem).rename(folder)
        except OSError:
            if not folder.is_dir():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(source: Path, out: Path, progress: bool) -> None:
    reader = GGUFReader(source)
    meta = GGUFMetadata(reader, str(source))
    config = hf_config(meta)
    check_tensor_types(reader.tensors, str(source))
    names = {tensor.name: hf_name(tensor.name, str(source)) for tensor in reader.tensors}
    out.mkdir(parents=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    _write_tokenizer(source, out)
    _write_weights(reader, names, config, out, progress)


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


def _write_tokenizer(source: Path, out: Path) -> None:
    # transformers' converter reads the vocabulary, merges, special tokens and
    # chat template from the metadata; it is only used here, never on the
    # serving path, which reads the saved tokenizer.json.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise GGUFError(f"{source}: the tokenizer in its metadata cannot be read: {exc}") from exc
    tokenizer.save_pretrained(str(out))


def _write_weights(
    reader: GGUFReader, names: dict[str, str], config: dict[str, Any], out: Path, progress: bool
) -> None:
    shards = _shards(reader.tensors)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weight_map: dict[str, str] = {}
    with tqdm(
        total=len(reader.tensors),
        unit="tensor",
        desc=f"dequantizing {out.name}",
        disable=not progress,
    ) as bar:
        for shard, file_name in zip(shards, files, strict=True):
            tensors = {}
            for tensor in shard:
                tensors[names[tensor.name]] = to_torch(tensor, heads, kv_heads)
                bar.update()
            write_safetensors(out / file_name, tensors)
            weight_map.update(dict.fromkeys(tensors, file_name))
    if len(files) > 1:
        _write_json(out / "model.safetensors.index.json", {"weight_map": weight_map})


def _shards(tensors: list[ReaderTensor]) -> list[list[ReaderTensor]]:
    shards: list[list[ReaderTensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = int(tensor.n_elements) * output_dtype(tensor).itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
