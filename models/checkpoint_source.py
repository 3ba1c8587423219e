"""What `model:` may name, resolved to the checkpoint folder every loader reads.

a Hugging Face folder (config.json inside)  -> itself
a .gguf file                                -> its cached converted folder
a folder holding exactly one .gguf file     -> that file's cached folder
"""

from __future__ import annotations

from pathlib import Path

from models.errors import CheckpointError

GGUF_SUFFIX = ".gguf"


def model_source(model: Path | str) -> Path:
    """What `model` stands for on disk: its GGUF file, or else the path itself
    (a checkpoint folder). This is what a node without it is sent."""
    path = Path(model)
    return _gguf_file(path) or path


def checkpoint_folder(
    model: Path | str, cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """The checkpoint folder for `model`; converts a GGUF file once (see
    `models.gguf.cache`). Anything else is returned unchanged for the config
    loader to report on."""
    path = Path(model)
    gguf_file = _gguf_file(path)
    if gguf_file is None:
        return path
    from models.gguf.cache import cached_checkpoint

    return cached_checkpoint(gguf_file, cache_dir, progress)


def _gguf_file(path: Path) -> Path | None:
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} not found")
        return path
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint: name a folder holding config.json and "
            f"*.safetensors, or a {GGUF_SUFFIX} file"
        )
    if not path.is_dir() or (path / "config.json").exists():
        return None
    candidates = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise CheckpointError(f"{path} holds several GGUF files ({names}); name one of them")
    return candidates[0] if candidates else None
