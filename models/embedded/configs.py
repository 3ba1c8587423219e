"""config.json bodies of the embedded checkpoints, per architecture and size.

Each function returns the dict a real checkpoint of that architecture carries,
in the field names `transformers` serializes (`LlamaConfig`, `NemotronHConfig`,
and the Nemotron VL / Omni wrapper whose language model sits under
`llm_config`). Nothing here imports torch or transformers.

Sizes:

- `tiny` — hidden 64, a handful of layers, vocab 512: loads and runs in well
  under a second, for tests.
- `small` — hidden 512, 8+ layers, vocab 4096: big enough that one decode step
  is compute-bound on a CPU, for benchmarks and demos.
- `mini` — hidden 256, 4 Llama layers, vocab 4096: the served benchmark's
  model (`benchmarks.serve_compare`), light enough that two CPU cores serve
  dozens of concurrent requests, so the serving path shows in the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from models.embedded.tokenizer import (
    BOS_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKEN_IDS,
    STOP_TOKEN_IDS,
)

ARCHS: tuple[str, ...] = ("llama", "nemotron_h", "nemotron_vl")
SIZES: tuple[str, ...] = ("tiny", "small", "mini")
VL_ARCHITECTURES: tuple[str, ...] = (
    "NemotronH_Nano_VL_V2",
    "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Omni_Reasoning_V3",
)
DEFAULT_VL_ARCHITECTURE = VL_ARCHITECTURES[0]
# How a VL checkpoint's preprocessor_config.json sizes images: transformers'
# Omni dynamic resolution, or the released VL V2 tiles plus a thumbnail.
IMAGE_FORMATS: tuple[str, ...] = ("dynamic", "tiles")
DEFAULT_IMAGE_FORMAT = IMAGE_FORMATS[0]
DEFAULT_INITIALIZER_RANGE = 0.02
# Layers of the multi-token-prediction step `mtp=True` adds to a Nemotron-H
# (the Nemotron 3 Super release's pattern: attention, then MoE).
MTP_PATTERN = "*E"
MTP_ARCHS: tuple[str, ...] = ("nemotron_h", "nemotron_vl")
# The archs with a Nemotron-H layer pattern, and its layer characters.
HYBRID_ARCHS: tuple[str, ...] = ("nemotron_h", "nemotron_vl")
HYBRID_LAYER_CHARS: tuple[str, ...] = ("M", "*", "-", "E")
# `model_type` of each wrapper. The transformers-native Omni class registers
# "nemotron_h_omni"; the remote-code releases use the class name itself.
VL_MODEL_TYPES: dict[str, str] = {
    "NemotronH_Nano_VL_V2": "NemotronH_Nano_VL_V2",
    "NemotronH_Nano_Omni_Reasoning_V3": "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Omni_Reasoning_V3": "nemotron_h_omni",
}

PAD_TOKEN_ID = SPECIAL_TOKEN_IDS[PAD_TOKEN]
BOS_TOKEN_ID = SPECIAL_TOKEN_IDS[BOS_TOKEN]
# Every token that ends a generation (`</s>`, `<|im_end|>`, `<|end|>`), as a
# list the way multi-EOS checkpoints (Llama 3, Nemotron) write it, so a chat
# turn stops at `<|im_end|>` for loaders that read only config.json.
EOS_TOKEN_IDS: tuple[int, ...] = STOP_TOKEN_IDS
IMAGE_TOKEN_ID = SPECIAL_TOKEN_IDS[IMAGE_TOKEN]
DTYPE = "float32"  # tests compare against transformers in fp32


@dataclass(frozen=True)
class _Shape:
    """Dimensions shared by every architecture at one size."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    llama_layers: int
    hybrid_pattern: str  # Nemotron-H: M = Mamba2, * = attention, - = MLP, E = MoE
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_n_groups: int
    ssm_state_size: int
    mamba_chunk_size: int
    moe_intermediate_size: int
    vision_hidden_size: int
    projector_hidden_size: int


_SHAPES: dict[str, _Shape] = {
    "tiny": _Shape(
        vocab_size=512,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        llama_layers=2,
        hybrid_pattern="M*-ME*-",
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_n_groups=2,
        ssm_state_size=16,
        mamba_chunk_size=16,
        moe_intermediate_size=32,
        vision_hidden_size=32,
        projector_hidden_size=64,
    ),
    "small": _Shape(
        vocab_size=4096,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1536,
        llama_layers=8,
        hybrid_pattern="M-M*-ME-M*-ME",
        mamba_num_heads=16,
        mamba_head_dim=64,
        mamba_n_groups=4,
        ssm_state_size=64,
        mamba_chunk_size=64,
        moe_intermediate_size=512,
        vision_hidden_size=32,
        projector_hidden_size=256,
    ),
    "mini": _Shape(
        vocab_size=4096,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        llama_layers=4,
        hybrid_pattern="M*-ME*-",
        mamba_num_heads=8,
        mamba_head_dim=64,
        mamba_n_groups=2,
        ssm_state_size=32,
        mamba_chunk_size=64,
        moe_intermediate_size=256,
        vision_hidden_size=32,
        projector_hidden_size=128,
    ),
}


class UnknownCheckpointKindError(ValueError):
    """An arch, size or VL wrapper name outside the supported lists."""


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UnknownCheckpointKindError(f"{field} is {value!r}; use one of {', '.join(choices)}")


def shape_of(size: str) -> _Shape:
    """The dimensions of `size` (one of `SIZES`)."""
    _check_choice("size", size, SIZES)
    return _SHAPES[size]


def llama_config(size: str, initializer_range: float = DEFAULT_INITIALIZER_RANGE) -> dict[str, Any]:
    """A `LlamaForCausalLM` config.json body."""
    s = shape_of(size)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.llama_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "initializer_range": initializer_range,
        "rms_norm_eps": 1e-5,
        "use_cache": True,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": list(EOS_TOKEN_IDS),
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "dtype": DTYPE,
    }


def nemotron_h_config(
    size: str,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    mtp: bool = False,
    hybrid_pattern: str | None = None,
) -> dict[str, Any]:
    """A `NemotronHForCausalLM` config.json body.

    Carries both layer-list spellings: `hybrid_override_pattern` (what the
    released checkpoints ship) and `layers_block_type` (what `NemotronHConfig`
    serializes); they describe the same layers. `mtp` adds one
    multi-token-prediction step of `MTP_PATTERN` layers, in the released
    fields `num_nextn_predict_layers` and `mtp_hybrid_override_pattern`.
    `hybrid_pattern` replaces the size's layer pattern (`check_hybrid_pattern`).
    """
    s = shape_of(size)
    if hybrid_pattern is not None:
        s = replace(s, hybrid_pattern=check_hybrid_pattern(hybrid_pattern))
    names = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    config: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "hybrid_override_pattern": s.hybrid_pattern,
        "layers_block_type": [names[char] for char in s.hybrid_pattern],
        "num_hidden_layers": len(s.hybrid_pattern),
        "tie_word_embeddings": False,
        "use_cache": True,
        "num_logits_to_keep": 1,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": list(EOS_TOKEN_IDS),
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "intermediate_size": s.intermediate_size,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "use_mamba_kernels": True,
        "ssm_state_size": s.ssm_state_size,
        "mamba_num_heads": s.mamba_num_heads,
        "mamba_head_dim": s.mamba_head_dim,
        "mamba_hidden_act": "silu",
        "n_groups": s.mamba_n_groups,
        "conv_kernel": 4,
        "expand": 2,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_limit": [0.0, float("inf")],
        "time_step_floor": 0.0001,
        "use_conv_bias": True,
        "chunk_size": s.mamba_chunk_size,
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": s.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": s.moe_intermediate_size,
        "moe_latent_size": None,
        "moe_shared_expert_overlap": True,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "num_nextn_predict_layers": 0,
        "use_bias": False,
        "initializer_range": initializer_range,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "hidden_dropout": 0.0,
        "rescale_prenorm_residual": True,
        "dtype": DTYPE,
    }
    if mtp:
        config["num_nextn_predict_layers"] = 1
        config["mtp_hybrid_override_pattern"] = MTP_PATTERN
    return config


def check_hybrid_pattern(pattern: str) -> str:
    """`pattern` if it is a Nemotron-H layer pattern (one of M, *, - or E per
    layer, with a Mamba or an attention layer among them); `ValueError` naming
    what is wrong otherwise."""
    bad = sorted(set(pattern) - set(HYBRID_LAYER_CHARS))
    if not pattern or bad:
        raise ValueError(
            f"hybrid pattern {pattern!r} must be one of {', '.join(HYBRID_LAYER_CHARS)} per "
            f"layer (M Mamba2, * attention, - MLP, E MoE){'; not ' + ''.join(bad) if bad else ''}"
        )
    if not set(pattern) & {"M", "*"}:
        raise ValueError(f"hybrid pattern {pattern!r} needs a Mamba (M) or attention (*) layer")
    return pattern


def radio_vision_config(size: str, initializer_range: float) -> dict[str, Any]:
    """A tiny RADIO vision tower config (the `vision_config` of the VL wrappers)."""
    s = shape_of(size)
    return {
        "model_type": "radio",
        "hidden_size": s.vision_hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "mlp_ratio": 4.0,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-6,
        "qkv_bias": True,
        "num_channels": 3,
        "patch_size": 16,
        "image_size": 64,
        "max_img_size": 64,
        "num_cls_tokens": 1,
        "num_registers": 1,
        "video_temporal_patch_size": 2,
        "initializer_range": initializer_range,
    }


def nemotron_vl_config(
    size: str,
    vl_architecture: str = DEFAULT_VL_ARCHITECTURE,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    mtp: bool = False,
    hybrid_pattern: str | None = None,
) -> dict[str, Any]:
    """An outer VL / Omni config.json body with the language model under `llm_config`.

    Field names follow the released checkpoints (`llm_config`,
    `vit_hidden_size`, `img_context_token_id`), which the transformers Omni
    config maps onto `text_config`, `vision_hidden_size` and `image_token_id`.
    """
    _check_choice("vl_architecture", vl_architecture, VL_ARCHITECTURES)
    s = shape_of(size)
    return {
        "architectures": [vl_architecture],
        "model_type": VL_MODEL_TYPES[vl_architecture],
        "llm_config": nemotron_h_config(size, initializer_range, mtp, hybrid_pattern),
        "vision_config": radio_vision_config(size, initializer_range),
        "force_image_size": 64,
        "downsample_ratio": 0.5,
        "projector_hidden_size": s.projector_hidden_size,
        "vit_hidden_size": s.vision_hidden_size,
        "video_pruning_rate": 0.0,
        "video_temporal_patch_size": 2,
        "img_context_token_id": IMAGE_TOKEN_ID,
        "initializer_range": initializer_range,
        "tie_word_embeddings": False,
        "dtype": DTYPE,
    }


def image_processor_config(size: str, image_format: str = DEFAULT_IMAGE_FORMAT) -> dict[str, Any]:
    """The `preprocessor_config.json` body of a VL checkpoint.

    `dynamic`: transformers' Omni image processor fields, with a patch budget
    small enough that an image takes 1 to 16 prompt tokens. `tiles`: the VL V2
    tiling fields, with tiles the size of the tiny tower's largest image (4
    tokens each) and at most 4 of them plus the thumbnail.
    """
    shape_of(size)
    _check_choice("image_format", image_format, IMAGE_FORMATS)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    if image_format == "tiles":
        # The released processor's field names (norm_mean / norm_std included).
        return {
            "image_processor_type": "NemotronNanoVLV2ImageProcessor",
            "image_size": 64,
            "max_num_tiles": 4,
            "use_thumbnail": True,
            "patch_size": 16,
            "downsample_ratio": 0.5,
            "norm_mean": mean,
            "norm_std": std,
        }
    return {
        "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
        "patch_size": 16,
        "downsample_ratio": 0.5,
        "min_num_patches": 4,
        "max_num_patches": 64,
        "max_model_len": 4096,
        "do_convert_rgb": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "resample": 3,
        "image_mean": mean,
        "image_std": std,
    }


def checkpoint_config(
    arch: str,
    size: str = "tiny",
    vl_architecture: str | None = None,
    initializer_range: float | None = None,
    mtp: bool = False,
    hybrid_pattern: str | None = None,
) -> dict[str, Any]:
    """The config.json body for `arch` at `size`.

    `vl_architecture` applies to `nemotron_vl` only (default
    `NemotronH_Nano_VL_V2`); `initializer_range` defaults to 0.02; `mtp`
    (`nemotron_h` and `nemotron_vl`) adds multi-token-prediction layers;
    `hybrid_pattern` (the same two) replaces the size's layer pattern.
    """
    _check_choice("arch", arch, ARCHS)
    if vl_architecture is not None and arch != "nemotron_vl":
        raise UnknownCheckpointKindError(
            f"vl_architecture is only meaningful for arch 'nemotron_vl', not {arch!r}; drop it"
        )
    if mtp and arch not in MTP_ARCHS:
        raise UnknownCheckpointKindError(
            f"mtp layers exist for arch {' and '.join(MTP_ARCHS)} only, not {arch!r}; drop it"
        )
    if hybrid_pattern is not None and arch not in HYBRID_ARCHS:
        raise UnknownCheckpointKindError(
            f"a hybrid pattern applies to arch {' and '.join(HYBRID_ARCHS)} only, not {arch!r}; "
            "drop it"
        )
    init = DEFAULT_INITIALIZER_RANGE if initializer_range is None else initializer_range
    if not init > 0:
        raise ValueError(f"initializer_range must be positive, got {init}")
    if arch == "llama":
        return llama_config(size, init)
    if arch == "nemotron_h":
        return nemotron_h_config(size, init, mtp, hybrid_pattern)
    vl = vl_architecture or DEFAULT_VL_ARCHITECTURE
    return nemotron_vl_config(size, vl, init, mtp, hybrid_pattern)


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's own config: `llm_config` of a wrapper, else `config`."""
    nested = config.get("llm_config")
    return nested if isinstance(nested, dict) else config
