"""Write a complete Hugging Face style checkpoint folder, offline.

Folder contents:

    config.json              architecture config (models.embedded.configs)
    generation_config.json   bos / eos / pad ids
    model.safetensors        seeded random weights, real on-disk key names
    tokenizer.json           byte-level BPE trained on the built-in corpus
    tokenizer_config.json    special tokens + ChatML chat template
    preprocessor_config.json image preprocessing (VL checkpoints only)
    embedded_checkpoint.json how the folder was made (arch, size, seed, ...)

Every file is written to a temporary name and renamed into place, and the
manifest `embedded_checkpoint.json` is written last, so a folder with a
manifest is complete: `ensure_checkpoint` trusts exactly that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from models.embedded.configs import (
    DEFAULT_IMAGE_FORMAT,
    DEFAULT_INITIALIZER_RANGE,
    UnknownCheckpointKindError,
    checkpoint_config,
    image_processor_config,
    language_model_config,
)
from models.embedded.tokenizer import tokenizer_files
from models.image_processing import PREPROCESSOR_FILE

MANIFEST_NAME = "embedded_checkpoint.json"
CHECKPOINT_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MANIFEST_NAME,
)
# Bump when the folder's contents change for the same arguments, so
# `ensure_checkpoint` rewrites folders made by an older layout.
FORMAT_VERSION = 2


class CheckpointWriteError(OSError):
    """The checkpoint folder cannot be created or written; the message says why."""


def write_checkpoint(
    out: Path,
    arch: str,
    size: str = "tiny",
    seed: int = 0,
    vl_architecture: str | None = None,
    initializer_range: float | None = None,
    progress: bool = False,
    image_format: str | None = None,
    mtp: bool = False,
    hybrid_pattern: str | None = None,
) -> Path:
    """Write a complete checkpoint for `arch` at `size` into the folder `out`.

    `image_format` (`nemotron_vl` only) picks the preprocessor_config.json:
    `dynamic` (transformers' Omni format, the default) or `tiles` (VL V2).
    `mtp` (`nemotron_h`, `nemotron_vl`) adds one multi-token-prediction step
    to config.json and its `mtp.layers.*` tensors to model.safetensors.
    `hybrid_pattern` (the same two) replaces the size's layer pattern, e.g.
    `"M-M*-M-M*-M"` for a hybrid without MoE layers.

    The same arguments always give a byte-identical model.safetensors.
    Existing checkpoint files in `out` are replaced; other files are left
    alone. Returns `out`. Raises `CheckpointWriteError` when `out` is a file or
    cannot be created or written, and `ValueError` for unknown arch / size /
    VL wrapper names.
    """
    out = Path(out)
    config = checkpoint_config(arch, size, vl_architecture, initializer_range, mtp, hybrid_pattern)
    image_format = _image_format(arch, image_format)
    _prepare_folder(out)
    try:
        _write_all(out, config, size, seed, progress, image_format)
        manifest = _manifest(arch, size, seed, config, image_format, mtp, hybrid_pattern)
        _write_json(out / MANIFEST_NAME, manifest)
    except OSError as error:
        raise CheckpointWriteError(
            f"cannot write checkpoint into {out}: {_reason(error)}"
        ) from error
    return out


def ensure_checkpoint(
    out: Path,
    arch: str,
    size: str = "tiny",
    seed: int = 0,
    vl_architecture: str | None = None,
    initializer_range: float | None = None,
    image_format: str | None = None,
    mtp: bool = False,
    hybrid_pattern: str | None = None,
) -> Path:
    """Return `out`, writing the checkpoint first unless an identical one is there.

    "Identical" means a complete folder (every file present, manifest last)
    whose manifest records the same arguments and format version.
    """
    out = Path(out)
    config = checkpoint_config(arch, size, vl_architecture, initializer_range, mtp, hybrid_pattern)
    image_format = _image_format(arch, image_format)
    manifest = _manifest(arch, size, seed, config, image_format, mtp, hybrid_pattern)
    if read_manifest(out) == manifest and is_complete(out):
        return out
    return write_checkpoint(
        out,
        arch,
        size,
        seed,
        vl_architecture,
        initializer_range,
        image_format=image_format,
        mtp=mtp,
        hybrid_pattern=hybrid_pattern,
    )


def is_complete(out: Path) -> bool:
    """True when every checkpoint file exists in `out` (the manifest is written last)."""
    return all((Path(out) / name).is_file() for name in CHECKPOINT_FILES)


def read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint in `out`, or None when absent or unreadable."""
    try:
        data = json.loads((Path(out) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _image_format(arch: str, image_format: str | None) -> str | None:
    """The VL checkpoint's image format (default `dynamic`); None for text models."""
    if arch != "nemotron_vl":
        if image_format is not None:
            raise UnknownCheckpointKindError(
                f"image_format is only meaningful for arch 'nemotron_vl', not {arch!r}; drop it"
            )
        return None
    return image_format or DEFAULT_IMAGE_FORMAT


def _manifest(
    arch: str,
    size: str,
    seed: int,
    config: dict[str, Any],
    image_format: str | None,
    mtp: bool = False,
    hybrid_pattern: str | None = None,
) -> dict[str, Any]:
    architecture = config["architectures"][0]
    manifest = {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "size": size,
        "seed": seed,
        "architecture": architecture,
        "initializer_range": language_model_config(config).get(
            "initializer_range", DEFAULT_INITIALIZER_RANGE
        ),
    }
    if image_format is not None:
        manifest["image_format"] = image_format
    if mtp:  # recorded only when set: folders made without it keep their manifest
        manifest["mtp"] = True
    if hybrid_pattern is not None:
        manifest["hybrid_pattern"] = hybrid_pattern
    return manifest


def _write_all(
    out: Path,
    config: dict[str, Any],
    size: str,
    seed: int,
    progress: bool,
    image_format: str | None,
) -> None:
    from models.embedded.safetensors_file import write_safetensors
    from models.embedded.weights import build_state_dict

    llm = language_model_config(config)
    for name, text in tokenizer_files(llm["vocab_size"]).items():
        _write_text(out / name, text)
    _write_json(out / "generation_config.json", _generation_config(llm))
    if image_format is not None:
        _write_json(out / PREPROCESSOR_FILE, image_processor_config(size, image_format))
    tensors = build_state_dict(config, seed)
    tmp = _tmp_path(out / "model.safetensors")
    try:
        write_safetensors(
            tmp,
            tensors,
            metadata={"format": "pt"},
            progress=progress,
            description="model.safetensors",
        )
        os.replace(tmp, out / "model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)
    # config.json goes after the weights: a loader never sees a config whose
    # weights are still being written.
    _write_json(out / "config.json", config)


def _generation_config(llm: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": llm["bos_token_id"],
        "eos_token_id": list(llm["eos_token_id"]),
        "pad_token_id": llm["pad_token_id"],
        "do_sample": False,
    }


def _prepare_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointWriteError(
            f"{out} is an existing file; give a folder path for the checkpoint"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointWriteError(f"cannot create folder {out}: {_reason(error)}") from error
    if not os.access(out, os.W_OK | os.X_OK):
        raise CheckpointWriteError(f"folder {out} is not writable; choose another output folder")
    try:
        # The manifest marks a complete folder; drop it before any file changes.
        (out / MANIFEST_NAME).unlink(missing_ok=True)
    except OSError as error:
        raise CheckpointWriteError(f"cannot write into folder {out}: {_reason(error)}") from error


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _write_text(path: Path, text: str) -> None:
    tmp = _tmp_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_text(path, json.dumps(data, indent=2) + "\n")
