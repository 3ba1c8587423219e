"""Errors raised while reading a model from disk.

Each names what is wrong and where, so the user knows which file or tensor to
fix: a bad `config.json` field (`ConfigError`), an architecture the project
does not implement (`UnsupportedArchitectureError`), or weights that do not
match the model built from the config (`CheckpointError`).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint's config is missing a field or holds an invalid value."""


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture has no model class in the registry."""

    def __init__(self, architecture: str, supported: tuple[str, ...]) -> None:
        self.architecture = architecture
        self.supported = supported
        super().__init__(
            f"architecture {architecture!r} is not supported; "
            f"supported architectures: {', '.join(supported)}"
        )


class CheckpointError(ValueError):
    """Checkpoint tensors do not match the model: missing, unexpected or mis-shaped."""


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or unusable."""


class GGUFError(CheckpointError):
    """A GGUF file this project cannot serve: unsupported architecture or tensor type,
    unknown tensor, or metadata that is missing or inconsistent."""
