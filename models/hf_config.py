"""Parse a Hugging Face `config.json` into the project's `ModelConfig`.

Supported families:

- dense decoders: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`;
- `NemotronHForCausalLM` in both layer-list styles (`hybrid_override_pattern`
  characters `M * - E`, or the newer `layers_block_type` list) and with the
  legacy `mamba_*` field aliases; its multi-token-prediction layers from
  `num_nextn_predict_layers` and `mtp_hybrid_override_pattern` (or
  `mtp_layers_block_type`);
- VL / Omni wrappers around Nemotron-H, whose language model config is nested
  under `llm_config` or `text_config`. The result keeps the outer architecture
  name (it selects the wrapper class) and takes every field from the nested
  config; `vocab_size` falls back to the outer config.

Field names and defaults follow `transformers`' own config classes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcache.dtypes import DTYPE_NAMES
from models.config import (
    ATTENTION,
    DECODER,
    MAMBA,
    MLP,
    MOE,
    MambaConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
    VisionConfig,
)
from models.errors import ConfigError, UnsupportedArchitectureError
from models.registry import WRAPPER_ARCHITECTURES, is_supported, supported_architectures

CONFIG_FILE = "config.json"
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
HYBRID_ARCHITECTURE = "NemotronHForCausalLM"
NESTED_CONFIG_KEYS = ("llm_config", "text_config")
IMAGE_TOKEN_FIELDS = ("image_token_id", "img_context_token_id")

# `hybrid_override_pattern` characters and `layers_block_type` names (both the
# legacy and the current transformers spelling) -> ModelConfig layer kinds.
_PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_BLOCK_TYPES = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}


def load_model_config(checkpoint_dir: Path) -> ModelConfig:
    """Read and parse `<checkpoint_dir>/config.json`."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found; a checkpoint folder must hold a config.json")
    try:
        # json accepts the `Infinity` literal some configs use in `time_step_limit`.
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(raw).__name__}")
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: Mapping[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
    """Build a `ModelConfig` from a config.json dict; `source` names it in errors."""
    architecture = _architecture(raw, source)
    if architecture in WRAPPER_ARCHITECTURES:
        return _parse_wrapper(raw, architecture, source)
    return _parse_language_model(_Fields(raw, source), architecture)


class _Fields:
    """Typed access to one config dict; errors name the field and the file."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def has(self, *names: str) -> bool:
        return any(self.raw.get(name) is not None for name in names)

    def first(self, *names: str, default: Any = None, required: bool = False) -> Any:
        """Value of the first name present (aliases in order of preference)."""
        for name in names:
            if self.raw.get(name) is not None:
                return self.raw[name]
        if required:
            raise ConfigError(f"{self.source}: required field {names[0]!r} is missing")
        return default

    def integer(self, *names: str, default: int | None = None, positive: bool = True) -> int:
        value = self.first(*names, default=default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
            kind = "a positive integer" if positive else "an integer"
            raise ConfigError(f"{self.source}: field {names[0]!r} must be {kind}, got {value!r}")
        return value

    def number(self, *names: str, default: float | None = None) -> float:
        value = self.first(*names, default=default, required=default is None)
        return _as_float(value, names[0], self.source)

    def flag(self, *names: str, default: bool) -> bool:
        value = self.first(*names, default=default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: field {names[0]!r} must be true or false")
        return value

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")


def _as_float(value: Any, name: str, source: str) -> float:
    # Strings cover configs written with "Infinity"/"inf" quoted; transformers
    # 5.x writes non-finite floats as {"__float__": "Infinity"}.
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{source}: field {name!r} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{source}: field {name!r} must be a number, got {value!r}") from None


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    names = raw.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise ConfigError(
            f"{source}: field 'architectures' must be a non-empty list of class names"
        )
    if not is_supported(names[0]):
        raise UnsupportedArchitectureError(names[0], supported_architectures())
    return names[0]


def _parse_wrapper(raw: Mapping[str, Any], architecture: str, source: str) -> ModelConfig:
    key = next((k for k in NESTED_CONFIG_KEYS if isinstance(raw.get(k), dict)), None)
    if key is None:
        raise ConfigError(
            f"{source}: {architecture} needs its language model config under one of "
            f"{', '.join(NESTED_CONFIG_KEYS)}"
        )
    nested: dict[str, Any] = dict(raw[key])
    # The outer config may carry what the nested one leaves out.
    for name in ("vocab_size", "eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if nested.get(name) is None and raw.get(name) is not None:
            nested[name] = raw[name]
    inner_names = nested.get("architectures")
    inner = inner_names[0] if isinstance(inner_names, list) and inner_names else None
    inner = inner or HYBRID_ARCHITECTURE
    if inner in WRAPPER_ARCHITECTURES or not is_supported(inner):
        raise UnsupportedArchitectureError(inner, supported_architectures())
    parsed = _parse_language_model(_Fields(nested, f"{source} [{key}]"), inner)
    # Without a placeholder token id no prompt can hold an image: text only.
    has_images = raw.get("vision_config") and _Fields(raw, source).has(*IMAGE_TOKEN_FIELDS)
    vision = _parse_vision(_Fields(raw, source), nested) if has_images else None
    return replace(parsed, architecture=architecture, vision=vision)


def _parse_vision(outer: _Fields, language_model: Mapping[str, Any]) -> VisionConfig:
    """The RADIO tower and projector of a wrapper; defaults follow transformers'
    `RadioConfig` and `NemotronH_Omni_Reasoning_V3_Config`."""
    if not isinstance(outer.raw["vision_config"], dict):
        raise outer.error("field 'vision_config' must be an object")
    f = _Fields(outer.raw["vision_config"], f"{outer.source} [vision_config]")
    if f.first("model_type", default="radio") != "radio":
        raise f.error(f"model_type is {f.first('model_type')!r}; only 'radio' towers are supported")
    if f.flag("use_swiglu_ffn", default=False):
        raise f.error("use_swiglu_ffn is true; only the GELU MLP of C-RADIO is supported")
    hidden_act = f.first("hidden_act", default="gelu")
    if hidden_act != "gelu":
        raise f.error(f"hidden_act is {hidden_act!r}; only 'gelu' is supported")
    hidden = f.integer("hidden_size", default=1280)
    outer_hidden = outer.integer("vision_hidden_size", "vit_hidden_size", default=hidden)
    if outer_hidden != hidden:
        raise outer.error(
            f"vision_hidden_size is {outer_hidden} but vision_config.hidden_size is {hidden}"
        )
    ratio = outer.number("downsample_ratio", default=0.5)
    if not 0 < ratio <= 1 or abs(1 / ratio - round(1 / ratio)) > 1e-6:
        raise outer.error(f"field 'downsample_ratio' must be 1/n for an integer n, got {ratio}")
    return VisionConfig(
        hidden_size=hidden,
        num_layers=f.integer("num_hidden_layers", default=32),
        num_heads=f.integer("num_attention_heads", default=16),
        mlp_ratio=f.number("mlp_ratio", default=4.0),
        layer_norm_eps=f.number("layer_norm_eps", default=1e-6),
        qkv_bias=f.flag("qkv_bias", default=True),
        num_channels=f.integer("num_channels", default=3),
        patch_size=f.integer("patch_size", default=16),
        max_img_size=f.integer("max_img_size", default=2048),
        num_prefix_tokens=f.integer("num_cls_tokens", default=3)
        + f.integer("num_registers", default=7, positive=False),
        downsample_ratio=ratio,
        projector_hidden_size=outer.integer("projector_hidden_size", default=4096),
        image_token_id=outer.integer(*IMAGE_TOKEN_FIELDS, positive=False),
        final_layernorm=bool(language_model.get("num_nextn_predict_layers") or 0),
    )


def _parse_language_model(f: _Fields, architecture: str) -> ModelConfig:
    if architecture == HYBRID_ARCHITECTURE:
        return _parse_nemotron_h(f, architecture)
    if architecture in DENSE_ARCHITECTURES:
        return _parse_dense(f, architecture)
    raise UnsupportedArchitectureError(architecture, supported_architectures())


def _attention_shape(f: _Fields) -> dict[str, int]:
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise f.error(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    default_head_dim = hidden // heads if hidden % heads == 0 else None
    head_dim = f.integer("head_dim", "attention_head_dim", default=default_head_dim)
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


def _common_fields(f: _Fields) -> dict[str, Any]:
    eos = f.first("eos_token_id", default=[])
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise f.error(f"field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
    dtype_name = f.first("dtype", "torch_dtype", default="float32")
    if dtype_name not in DTYPE_NAMES:
        raise f.error(f"field 'torch_dtype' is {dtype_name!r}; use one of {sorted(DTYPE_NAMES)}")
    bos = f.first("bos_token_id")
    return {
        "vocab_size": f.integer("vocab_size"),
        "max_position_embeddings": f.integer("max_position_embeddings", default=4096),
        "tie_word_embeddings": f.flag("tie_word_embeddings", default=False),
        "eos_token_ids": eos_ids,
        "bos_token_id": bos if isinstance(bos, int) else None,
        "dtype": dtype_name,
        **_attention_shape(f),
    }


def _parse_dense(f: _Fields, architecture: str) -> ModelConfig:
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama's flag covers all four.
    attention_bias = True if is_qwen2 else f.flag("attention_bias", default=False)
    sliding_window = None
    if is_qwen2:
        if f.flag("use_sliding_window", default=False):
            raise f.error("use_sliding_window=true is not supported for Qwen2; set it to false")
    elif f.has("sliding_window"):
        sliding_window = f.integer("sliding_window")
    hidden_act = f.first("hidden_act", default="silu")
    if hidden_act != "silu":
        raise f.error(f"field 'hidden_act' is {hidden_act!r}; dense models support only 'silu'")
    return ModelConfig(
        architecture=architecture,
        layer_types=(DECODER,) * f.integer("num_hidden_layers"),
        intermediate_size=f.integer("intermediate_size"),
        rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
        attention_bias=attention_bias,
        attention_output_bias=False if is_qwen2 else None,
        sliding_window=sliding_window,
        mlp_bias=f.flag("mlp_bias", default=False),
        hidden_act=hidden_act,
        rope=_parse_rope(f),
        **_common_fields(f),
    )


_ROPE_TYPES = (None, "linear", "dynamic", "llama3")


def _parse_rope(f: _Fields) -> RopeConfig:
    """Rope from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
    params = f.first("rope_parameters") or f.first("rope_scaling") or {}
    if not isinstance(params, dict):
        raise f.error("field 'rope_scaling' must be an object or null")
    p = _Fields(params, f"{f.source} [rope_parameters]")
    theta = p.number("rope_theta", default=f.number("rope_theta", default=10000.0))
    rope_type = p.first("rope_type", "type", default="default")
    scaling = None if rope_type == "default" else rope_type
    if scaling not in _ROPE_TYPES:
        raise f.error(
            f"rope type {rope_type!r} is not supported; use one of "
            "'default', 'linear', 'dynamic', 'llama3'"
        )
    original = p.first("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        scaling_type=scaling,
        factor=p.number("factor", default=1.0),
        low_freq_factor=p.number("low_freq_factor", default=1.0),
        high_freq_factor=p.number("high_freq_factor", default=4.0),
        original_max_position_embeddings=original if isinstance(original, int) else None,
        partial_rotary_factor=p.number(
            "partial_rotary_factor", default=f.number("partial_rotary_factor", default=1.0)
        ),
    )


def _parse_nemotron_h(f: _Fields, architecture: str) -> ModelConfig:
    layer_types = _hybrid_layer_types(f)
    num_mtp = f.integer("num_nextn_predict_layers", default=0, positive=False)
    if num_mtp < 0:
        raise f.error(f"field 'num_nextn_predict_layers' must be 0 or more, got {num_mtp}")
    mtp_layer_types = _mtp_layer_types(f, num_mtp) if num_mtp else ()
    all_kinds = layer_types + mtp_layer_types
    return ModelConfig(
        architecture=architecture,
        layer_types=layer_types,
        intermediate_size=f.integer("intermediate_size", default=21504),
        rms_norm_eps=f.number("layer_norm_epsilon", "rms_norm_eps", default=1e-5),
        attention_bias=f.flag("attention_bias", default=False),
        mlp_bias=f.flag("mlp_bias", default=False),
        hidden_act=f.first("mlp_hidden_act", "hidden_act", default="relu2"),
        # Nemotron-H attention layers carry no positional encoding; Mamba orders tokens.
        rope=None,
        mamba=_parse_mamba(f) if MAMBA in layer_types else None,
        moe=_parse_moe(f) if MOE in all_kinds else None,
        num_nextn_predict_layers=num_mtp,
        mtp_layer_types=mtp_layer_types,
        **_common_fields(f),
    )


def _hybrid_layer_types(f: _Fields) -> tuple[str, ...]:
    block_types = f.first("layers_block_type", "layer_types")
    if block_types is not None:
        if not isinstance(block_types, list) or not block_types:
            raise f.error("field 'layers_block_type' must be a non-empty list of layer kinds")
        unknown = sorted({t for t in block_types if t not in _BLOCK_TYPES}, key=str)
        if unknown:
            raise f.error(
                f"field 'layers_block_type' has unknown kinds {unknown}; use {sorted(_BLOCK_TYPES)}"
            )
        return tuple(_BLOCK_TYPES[t] for t in block_types)
    pattern = f.first("hybrid_override_pattern", required=True)
    if not isinstance(pattern, str) or not pattern:
        raise f.error("field 'hybrid_override_pattern' must be a non-empty string")
    unknown_chars = sorted(set(pattern) - set(_PATTERN_CHARS))
    if unknown_chars:
        raise f.error(
            f"field 'hybrid_override_pattern' has unknown characters {unknown_chars}; "
            "use M (mamba), * (attention), - (mlp), E (moe)"
        )
    num_layers = f.integer("num_hidden_layers", default=len(pattern))
    if num_layers != len(pattern):
        raise f.error(
            f"field 'hybrid_override_pattern' has {len(pattern)} layers but "
            f"num_hidden_layers is {num_layers}"
        )
    return tuple(_PATTERN_CHARS[c] for c in pattern)


def _mtp_layer_types(f: _Fields, num_mtp: int) -> tuple[str, ...]:
    """One MTP step's layer kinds: `mtp_hybrid_override_pattern` (what the
    released checkpoints ship) or `mtp_layers_block_type` (what transformers'
    `NemotronHConfig` serializes)."""
    pattern = f.first("mtp_hybrid_override_pattern")
    if pattern is None and f.has("mtp_layers_block_type"):
        block_types = f.first("mtp_layers_block_type")
        if not isinstance(block_types, list) or not block_types:
            raise f.error("field 'mtp_layers_block_type' must be a non-empty list of layer kinds")
        unknown = sorted({t for t in block_types if t not in _BLOCK_TYPES}, key=str)
        if unknown:
            raise f.error(
                f"field 'mtp_layers_block_type' has unknown kinds {unknown}; "
                f"use {sorted(_BLOCK_TYPES)}"
            )
        return tuple(_BLOCK_TYPES[t] for t in block_types)
    if pattern is None:
        raise f.error(
            f"num_nextn_predict_layers is {num_mtp} but field 'mtp_hybrid_override_pattern' "
            'is missing; give the MTP layers\' pattern (e.g. "*E") or set '
            "num_nextn_predict_layers to 0"
        )
    if not isinstance(pattern, str) or not pattern:
        raise f.error("field 'mtp_hybrid_override_pattern' must be a non-empty string")
    unknown_chars = sorted(set(pattern) - set(_PATTERN_CHARS))
    if unknown_chars:
        raise f.error(
            f"field 'mtp_hybrid_override_pattern' has unknown characters {unknown_chars}; "
            "use * (attention), - (mlp), E (moe)"
        )
    return tuple(_PATTERN_CHARS[c] for c in pattern)


def _parse_mamba(f: _Fields) -> MambaConfig:
    limit = f.first("time_step_limit", "mamba_dt_limit", default=[0.0, math.inf])
    if not isinstance(limit, list | tuple) or len(limit) != 2:
        raise f.error(f"field 'time_step_limit' must be a [min, max] pair, got {limit!r}")
    low, high = (_as_float(v, "time_step_limit", f.source) for v in limit)
    return MambaConfig(
        num_heads=f.integer("mamba_num_heads", default=128),
        head_dim=f.integer("mamba_head_dim", default=64),
        state_size=f.integer("ssm_state_size", "mamba_d_state", "mamba_state_size", default=128),
        n_groups=f.integer("n_groups", "mamba_n_groups", default=8),
        conv_kernel=f.integer("conv_kernel", "mamba_d_conv", default=4),
        chunk_size=f.integer("chunk_size", "mamba_chunk_size", default=128),
        use_conv_bias=f.flag("use_conv_bias", "mamba_conv_bias", default=True),
        use_bias=f.flag("use_bias", "mamba_proj_bias", default=False),
        time_step_limit=(low, high),
        time_step_min=f.number("time_step_min", "mamba_dt_min", default=0.001),
        norm_eps=f.number("layer_norm_epsilon", "rms_norm_eps", default=1e-5),
    )


def _parse_moe(f: _Fields) -> MoEConfig:
    num_experts = f.integer("n_routed_experts", "num_local_experts", "num_experts")
    top_k = f.integer("num_experts_per_tok")
    if top_k > num_experts:
        raise f.error(f"num_experts_per_tok ({top_k}) exceeds n_routed_experts ({num_experts})")
    n_shared = f.integer("n_shared_experts", default=1, positive=False)
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=f.integer("moe_intermediate_size"),
        shared_intermediate_size=(
            f.integer("moe_shared_expert_intermediate_size", default=0, positive=False)
            if n_shared > 0
            else 0
        ),
        n_group=f.integer("n_group", default=1),
        topk_group=f.integer("topk_group", default=1),
        routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
        norm_topk_prob=f.flag("norm_topk_prob", default=True),
    )
