"""config.json parsing: dense families, Nemotron-H styles and aliases, VL wrappers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import transformers

from models.config import ATTENTION, DECODER, MAMBA, MLP, MOE
from models.errors import ConfigError, UnsupportedArchitectureError
from models.hf_config import load_model_config, parse_model_config


def llama_dict(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "eos_token_id": [2, 7],
        "bos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


def nemotron_h_dict(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 32,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 64,
        "layer_norm_epsilon": 1e-5,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "hybrid_override_pattern": "M*-ME",
        "num_hidden_layers": 5,
    }
    raw.update(overrides)
    return raw


def test_llama_fields() -> None:
    config = parse_model_config(llama_dict(head_dim=32, num_attention_heads=2))
    assert config.architecture == "LlamaForCausalLM"
    assert config.layer_types == (DECODER, DECODER)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 2, 32)
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1
    assert config.dtype == "bfloat16" and config.rms_norm_eps == 1e-5
    assert config.rope is not None and config.rope.scaling_type is None
    assert config.cache_spec().attention_layers == (0, 1)


def test_llama_head_dim_defaults_to_hidden_over_heads() -> None:
    assert parse_model_config(llama_dict()).head_dim == 16


def test_rope_from_transformers_5_rope_parameters() -> None:
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = parse_model_config(llama_dict(rope_parameters=params)).rope
    assert rope is not None
    assert (rope.scaling_type, rope.theta, rope.factor) == ("llama3", 500000.0, 32.0)
    assert rope.original_max_position_embeddings == 8192


def test_rope_from_legacy_rope_theta_and_scaling() -> None:
    raw = llama_dict(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 4.0})
    rope = parse_model_config(raw).rope
    assert rope is not None
    assert (rope.scaling_type, rope.theta, rope.factor) == ("linear", 1e6, 4.0)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ConfigError, match="longrope"):
        parse_model_config(llama_dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}))


def test_qwen2_has_qkv_bias_without_output_bias() -> None:
    config = parse_model_config(llama_dict(architectures=["Qwen2ForCausalLM"]))
    assert config.attention_bias is True and config.attention_output_bias is False


def test_mistral_sliding_window() -> None:
    raw = llama_dict(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert parse_model_config(raw).sliding_window == 4096


def test_missing_field_names_field_and_file(tmp_path: Path) -> None:
    raw = llama_dict()
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json.*'hidden_size'"):
        load_model_config(tmp_path)


def test_invalid_field_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        parse_model_config(llama_dict(num_key_value_heads=3))
    with pytest.raises(ConfigError, match="vocab_size"):
        parse_model_config(llama_dict(vocab_size="256"))


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        parse_model_config(llama_dict(architectures=["GPT2LMHeadModel"]))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert "LlamaForCausalLM" in message and "NemotronHForCausalLM" in message


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        load_model_config(tmp_path)


def test_nemotron_h_override_pattern() -> None:
    config = parse_model_config(nemotron_h_dict())
    assert config.layer_types == (MAMBA, ATTENTION, MLP, MAMBA, MOE)
    assert config.rope is None and config.hidden_act == "relu2"
    assert config.mamba is not None and config.moe is not None
    assert (config.mamba.num_heads, config.mamba.head_dim, config.mamba.state_size) == (8, 16, 32)
    assert (config.mamba.n_groups, config.mamba.conv_kernel, config.mamba.chunk_size) == (2, 4, 64)
    assert config.mamba.time_step_limit == (0.0, math.inf)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
    assert (moe.shared_intermediate_size, moe.n_group, moe.topk_group) == (48, 2, 1)
    assert moe.routed_scaling_factor == 2.5 and moe.norm_topk_prob is True
    spec = config.cache_spec()
    assert spec.attention_layers == (1,) and spec.mamba_layers == (0, 3)
    assert spec.conv_state_shape == (8 * 16 + 2 * 2 * 32, 3)


@pytest.mark.parametrize(
    "block_types",
    [
        ["mamba", "attention", "mlp", "mamba", "moe"],
        ["linear_attention", "full_attention", "mlp", "linear_attention", "moe"],
    ],
    ids=["legacy-names", "transformers-5-names"],
)
def test_nemotron_h_layers_block_type(block_types: list[str]) -> None:
    raw = nemotron_h_dict(layers_block_type=block_types)
    del raw["hybrid_override_pattern"], raw["num_hidden_layers"]
    assert parse_model_config(raw).layer_types == (MAMBA, ATTENTION, MLP, MAMBA, MOE)


def test_nemotron_h_legacy_mamba_aliases() -> None:
    raw = nemotron_h_dict(
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=32,
        mamba_conv_bias=False,
        mamba_proj_bias=True,
        hybrid_override_pattern="M-M-",
        num_hidden_layers=4,
    )
    for name in ("n_groups", "conv_kernel", "chunk_size"):
        del raw[name]
    config = parse_model_config(raw)
    assert config.mamba is not None and config.moe is None
    mamba = config.mamba
    assert (mamba.n_groups, mamba.conv_kernel, mamba.chunk_size) == (4, 3, 32)
    assert mamba.use_conv_bias is False and mamba.use_bias is True


def test_nemotron_h_pattern_length_mismatch_is_named() -> None:
    with pytest.raises(ConfigError, match="hybrid_override_pattern.*num_hidden_layers is 7"):
        parse_model_config(nemotron_h_dict(num_hidden_layers=7))
    with pytest.raises(ConfigError, match="unknown characters"):
        parse_model_config(nemotron_h_dict(hybrid_override_pattern="M*X-E"))


def test_nemotron_h_mtp_layers() -> None:
    config = parse_model_config(
        nemotron_h_dict(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    )
    assert (config.num_nextn_predict_layers, config.mtp_layer_types) == (1, (ATTENTION, MOE))
    # Built and cached only when the engine asks for them.
    assert not config.use_mtp and config.cache_spec().attention_layers == (1,)
    plain = parse_model_config(nemotron_h_dict())
    assert (plain.num_nextn_predict_layers, plain.mtp_layer_types) == (0, ())
    # A pattern with 0 MTP layers is not read (transformers writes a default one).
    unused = parse_model_config(nemotron_h_dict(mtp_hybrid_override_pattern="*X"))
    assert unused.mtp_layer_types == ()


def test_nemotron_h_mtp_moe_layer_brings_the_moe_settings() -> None:
    raw = nemotron_h_dict(
        hybrid_override_pattern="M*-M",
        num_hidden_layers=4,
        num_nextn_predict_layers=1,
        mtp_hybrid_override_pattern="*E",
    )
    config = parse_model_config(raw)
    assert MOE not in config.layer_types
    assert config.moe is not None and config.moe.num_experts == 8


def test_nemotron_h_mtp_pattern_is_required_and_checked() -> None:
    with pytest.raises(
        ConfigError, match="num_nextn_predict_layers is 1 but field 'mtp_hybrid_override_pattern'"
    ):
        parse_model_config(nemotron_h_dict(num_nextn_predict_layers=1))
    with pytest.raises(
        ConfigError, match=r"'mtp_hybrid_override_pattern' has unknown characters \['X'\]"
    ):
        parse_model_config(
            nemotron_h_dict(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*X")
        )
    with pytest.raises(ConfigError, match="'num_nextn_predict_layers' must be 0 or more"):
        parse_model_config(nemotron_h_dict(num_nextn_predict_layers=-1))


def test_nemotron_h_mtp_layers_as_transformers_saves_them() -> None:
    """transformers serializes the MTP pattern as `mtp_layers_block_type` only."""
    hf = transformers.NemotronHConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        n_routed_experts=4,
        moe_intermediate_size=24,
        hybrid_override_pattern="ME*-",
        num_nextn_predict_layers=1,
        mtp_hybrid_override_pattern="-E*",
    )
    raw = hf.to_dict()
    raw["architectures"] = ["NemotronHForCausalLM"]
    assert "mtp_hybrid_override_pattern" not in raw
    config = parse_model_config(json.loads(json.dumps(raw)))
    assert config.mtp_layer_types == (MLP, MOE, ATTENTION)


def test_time_step_limit_with_json_infinity(tmp_path: Path) -> None:
    text = json.dumps(nemotron_h_dict()).replace(
        '"chunk_size": 64', '"chunk_size": 64, "time_step_limit": [0.0, Infinity]'
    )
    assert "Infinity" in text
    (tmp_path / "config.json").write_text(text)
    mamba = load_model_config(tmp_path).mamba
    assert mamba is not None and mamba.time_step_limit == (0.0, math.inf)
    assert parse_model_config(nemotron_h_dict(time_step_limit=[0.01, "inf"])).mamba is not None


def test_time_step_limit_as_transformers_saves_it(tmp_path: Path) -> None:
    """save_pretrained writes the default infinite limit as {"__float__": "Infinity"}."""
    config = transformers.NemotronHConfig(hidden_size=64, time_step_limit=(0.0, math.inf))
    config.architectures = ["NemotronHForCausalLM"]
    config.save_pretrained(tmp_path)
    assert '"__float__"' in (tmp_path / "config.json").read_text()
    mamba = load_model_config(tmp_path).mamba
    assert mamba is not None and mamba.time_step_limit == (0.0, math.inf)


def test_matches_transformers_nemotron_h_config() -> None:
    """Fields as transformers itself writes them (to_dict) parse to the same values."""
    hf = transformers.NemotronHConfig(
        vocab_size=300,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        n_routed_experts=4,
        moe_intermediate_size=24,
        hybrid_override_pattern="ME*-",
    )
    raw = hf.to_dict()
    raw["architectures"] = ["NemotronHForCausalLM"]
    config = parse_model_config(json.loads(json.dumps(raw)))
    assert config.layer_types == (MAMBA, MOE, ATTENTION, MLP)
    assert config.mamba is not None and config.moe is not None
    assert config.mamba.conv_dim == hf.mamba_num_heads * hf.mamba_head_dim + 2 * 2 * 16
    assert config.mamba.time_step_limit == tuple(hf.time_step_limit)
    assert config.moe.top_k == hf.num_experts_per_tok
    assert config.moe.shared_intermediate_size == hf.moe_shared_expert_intermediate_size
    assert config.rms_norm_eps == hf.layer_norm_epsilon


@pytest.mark.parametrize(
    ("architecture", "nested_key"),
    [
        ("NemotronH_Nano_VL_V2", "llm_config"),
        ("NemotronH_Nano_Omni_Reasoning_V3", "text_config"),
        ("NemotronH_Omni_Reasoning_V3", "llm_config"),
    ],
)
def test_vl_wrapper_takes_fields_from_nested_config(architecture: str, nested_key: str) -> None:
    raw = {
        "architectures": [architecture],
        "torch_dtype": "bfloat16",
        nested_key: nemotron_h_dict(),
        "vision_config": {"hidden_size": 1280},
    }
    config = parse_model_config(raw)
    assert config.architecture == architecture
    assert config.vocab_size == 512 and config.hidden_size == 64
    assert config.layer_types == (MAMBA, ATTENTION, MLP, MAMBA, MOE)
    assert config.dtype == "bfloat16"
    assert config.cache_spec().is_hybrid


def test_vl_wrapper_vision_config_parses_with_radio_defaults() -> None:
    raw = {
        "architectures": ["NemotronH_Nano_VL_V2"],
        "llm_config": {
            **nemotron_h_dict(),
            "num_nextn_predict_layers": 1,
            "mtp_hybrid_override_pattern": "*E",
        },
        "vision_config": {"model_type": "radio", "hidden_size": 32, "patch_size": 14},
        "vit_hidden_size": 32,
        "img_context_token_id": 6,
        "downsample_ratio": 0.25,
    }
    vision = parse_model_config(raw).vision
    assert vision is not None
    assert (vision.hidden_size, vision.patch_size, vision.image_token_id) == (32, 14, 6)
    assert (vision.num_layers, vision.num_prefix_tokens, vision.merge_size) == (32, 10, 4)
    assert vision.final_layernorm  # the language model has MTP layers
    assert vision.num_image_tokens((8, 12)) == 6
    without_token = {k: v for k, v in raw.items() if k != "img_context_token_id"}
    assert parse_model_config(without_token).vision is None
    with pytest.raises(ConfigError, match="vision_hidden_size is 48"):
        parse_model_config({**raw, "vit_hidden_size": 48})
    with pytest.raises(ConfigError, match="only 'radio'"):
        parse_model_config({**raw, "vision_config": {"model_type": "siglip"}})


def test_vl_wrapper_vocab_falls_back_to_outer() -> None:
    nested = nemotron_h_dict()
    del nested["vocab_size"]
    raw = {"architectures": ["NemotronH_Nano_VL_V2"], "vocab_size": 777, "llm_config": nested}
    assert parse_model_config(raw).vocab_size == 777


def test_vl_wrapper_without_nested_config() -> None:
    with pytest.raises(ConfigError, match="llm_config"):
        parse_model_config({"architectures": ["NemotronH_Nano_VL_V2"], "vocab_size": 10})
