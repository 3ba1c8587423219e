"""The interface every model class implements.

A model is built from a `ModelConfig`, runs one engine step over a
`ForwardBatch` against cache views it does not own, and turns chosen hidden
rows into logits. Weights arrive as `(on-disk name, tensor)` pairs; the class
maps names to its own parameters and refuses a checkpoint that does not fit.

Class attributes state what the model prefers from the `auto` resolution of
the cache manager and the transceiver (`None` = no preference); the registry
reads them without building a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from kvcache.views import CacheViews
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.errors import CheckpointError

# How many names a CheckpointError lists per category before summarizing.
_MAX_NAMES_SHOWN = 20


class CausalLM(torch.nn.Module):
    """Base class of all decoder-only models served by the project."""

    preferred_kv_manager: ClassVar[str | None] = None
    preferred_transceiver: ClassVar[str | None] = None
    # Whether the class runs as tensor-parallel shards (`models.tensor_parallel`).
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        """Run one step; return hidden states `[batch.num_tokens, hidden_size]`.

        Writes the step's new KV (and Mamba state) into `caches` through the
        addressing in `batch`; allocates no cache memory.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, vocab_size]` for hidden rows `[N, hidden_size]`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement compute_logits")

    def checkpoint_name(self, disk_name: str) -> str | None:
        """Map an on-disk tensor name to a parameter name; `None` skips the tensor.

        The default is the identity: module names follow the checkpoint's.
        """
        return disk_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters, casting to their dtype.

        Raises `CheckpointError` listing every missing parameter, every
        unexpected tensor and every shape mismatch (name, expected, found);
        nothing is partially reported.
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        mismatched: list[str] = []
        for disk_name, tensor in weights:
            name = self.checkpoint_name(disk_name)
            if name is None:
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(disk_name)
                continue
            seen.add(name)
            if tuple(tensor.shape) != tuple(param.shape):
                mismatched.append(
                    f"{disk_name}: expected shape {tuple(param.shape)}, found {tuple(tensor.shape)}"
                )
                continue
            with torch.no_grad():
                param.copy_(tensor.to(dtype=param.dtype))
        missing = sorted(set(params) - seen)
        if missing or unexpected or mismatched:
            raise CheckpointError(self._describe_mismatch(missing, unexpected, mismatched))

    def process_weights_after_loading(self) -> None:
        """Rearrange loaded weights for inference (fusions, prepacking); the
        loader calls it once after `load_weights`. The default does nothing.
        A shape-only load (the checkpoint check, on the meta device) does not
        call it: there is nothing to rearrange."""

    def _describe_mismatch(
        self, missing: list[str], unexpected: list[str], mismatched: list[str]
    ) -> str:
        parts = [f"checkpoint does not match {type(self).__name__} built from its config"]
        for label, names in (
            ("shape mismatches", mismatched),
            ("missing tensors", missing),
            ("unexpected tensors", sorted(unexpected)),
        ):
            if names:
                shown = ", ".join(names[:_MAX_NAMES_SHOWN])
                more = len(names) - _MAX_NAMES_SHOWN
                parts.append(f"{label}: {shown}" + (f" (+{more} more)" if more > 0 else ""))
        return "; ".join(parts)
