"""Architecture name -> model class, resolved lazily.

The table maps the `architectures[0]` string of a checkpoint's config.json to a
`"module:Class"` path. Nothing is imported until a class is asked for, so this
module (and anything that only needs `supported_architectures()` or the `auto`
preferences) stays free of torch.

A model class states what it prefers from the cache and transfer layers with
two class attributes, `preferred_kv_manager` and `preferred_transceiver`
(`None` = no preference); `model_preferences` reads them.
"""

from __future__ import annotations

import importlib
from typing import Any

from models.config import ModelConfig
from models.errors import ConfigError, UnsupportedArchitectureError
from models.sharding import check_shardable

_DENSE = "models.llama:LlamaForCausalLM"
_HYBRID = "models.nemotron_h:NemotronHForCausalLM"
_HYBRID_VL = "models.nemotron_vl:NemotronVLForCausalLM"

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": _DENSE,
    "Qwen2ForCausalLM": _DENSE,
    "MistralForCausalLM": _DENSE,
    "NemotronHForCausalLM": _HYBRID,
    "NemotronH_Nano_VL_V2": _HYBRID_VL,
    "NemotronH_Nano_Omni_Reasoning_V3": _HYBRID_VL,
    "NemotronH_Omni_Reasoning_V3": _HYBRID_VL,
}

# Outer architectures whose language model config sits one level down, under
# `llm_config` or `text_config`.
WRAPPER_ARCHITECTURES: frozenset[str] = frozenset(
    name for name, path in _ARCHITECTURES.items() if path == _HYBRID_VL
)


def supported_architectures() -> tuple[str, ...]:
    """All architecture names a checkpoint may declare, sorted."""
    return tuple(sorted(_ARCHITECTURES))


def is_supported(architecture: str) -> bool:
    return architecture in _ARCHITECTURES


def model_class_path(architecture: str) -> str:
    """The `"module:Class"` path of an architecture, without importing it."""
    try:
        return _ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(architecture, supported_architectures()) from None


def model_class_for(architecture: str) -> Any:
    """Import and return the model class of `architecture`.

    Raises `UnsupportedArchitectureError` for an unknown name; an `ImportError`
    from the model module itself propagates unchanged.
    """
    module_name, _, class_name = model_class_path(architecture).partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)


def model_preferences(architecture: str) -> tuple[str | None, str | None]:
    """`(preferred_kv_manager, preferred_transceiver)` of the architecture's class.

    Each is a backend name (for example `"v2"`, `"python"`) or `None` when the
    class has no preference and the `auto` rules pick the default.
    """
    cls = model_class_for(architecture)
    return (
        getattr(cls, "preferred_kv_manager", None),
        getattr(cls, "preferred_transceiver", None),
    )


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise `ConfigError` unless `size` ranks can run this model: its class
    must shard, and `size` must split its heads and widths (the error then
    names the field and the allowed sizes)."""
    if size != 1 and not model_class_for(config.architecture).supports_tensor_parallel:
        raise ConfigError(
            f"tensor_parallel_size {size}: {config.architecture} runs on one rank so far "
            "(Llama-style, Nemotron-H and Nemotron VL models shard); set tensor_parallel_size to 1"
        )
    check_shardable(config, size)
