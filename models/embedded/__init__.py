"""Embedded checkpoints: tiny / small Hugging Face style folders written offline.

`write_checkpoint(out, arch, size, seed)` writes config.json, generation
config, seeded random weights (model.safetensors, real on-disk key names) and a
byte-level BPE tokenizer with a chat template (`mtp=True`: Nemotron-H
multi-token-prediction layers too); `ensure_checkpoint` writes only
when the folder is missing or incomplete. `disagg make-checkpoint` is the
command-line front end (`models.embedded.cli`).

Importing this package does not import torch or transformers.
"""

from models.embedded.configs import (
    ARCHS,
    DEFAULT_VL_ARCHITECTURE,
    SIZES,
    VL_ARCHITECTURES,
    UnknownCheckpointKindError,
    checkpoint_config,
)
from models.embedded.writer import (
    CheckpointWriteError,
    ensure_checkpoint,
    is_complete,
    write_checkpoint,
)

__all__ = [
    "ARCHS",
    "DEFAULT_VL_ARCHITECTURE",
    "SIZES",
    "VL_ARCHITECTURES",
    "CheckpointWriteError",
    "UnknownCheckpointKindError",
    "checkpoint_config",
    "ensure_checkpoint",
    "is_complete",
    "write_checkpoint",
]
