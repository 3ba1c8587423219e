"""NemotronVLForCausalLM: the text path of a transformers Omni checkpoint, fp32.

The test writes a tiny `NemotronH_Omni_Reasoning_V3` (Nemotron-H language model
plus a one-block RADIO vision tower and projector) with transformers, loads it
through `models.loader`, and checks prefill + 32 greedy decode steps against
the Omni model's own forward on token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.models.nemotron_h_omni import (
    NemotronH_Omni_Reasoning_V3,
    NemotronH_Omni_Reasoning_V3_Config,
)

from models.errors import CheckpointError
from models.loader import iter_checkpoint_tensors, load_model
from models.nemotron_h import NemotronHForCausalLM
from models.nemotron_vl import NemotronVLForCausalLM
from models.registry import model_class_for, model_preferences
from tests.paged_harness import assert_matches_reference, run_paged_generation
from tests.unit.test_nemotron_h_parity import (
    DECODE_STEPS,
    prompts_of,
    randomize_ssm_and_router,
    tiny_config,
)

WRAPPER_NAMES = (
    "NemotronH_Nano_VL_V2",
    "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Omni_Reasoning_V3",
)


def write_omni_checkpoint(path: Path) -> NemotronH_Omni_Reasoning_V3:
    torch.manual_seed(0)
    vision = {
        "model_type": "radio",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 4,
        "image_size": 16,
        "max_img_size": 32,
        "num_cls_tokens": 1,
        "num_registers": 0,
        "video_temporal_patch_size": 2,
    }
    config = NemotronH_Omni_Reasoning_V3_Config(
        text_config=tiny_config().to_dict(),
        vision_config=vision,
        vision_hidden_size=32,
        projector_hidden_size=48,
        image_token_id=5,
    )
    reference = NemotronH_Omni_Reasoning_V3(config).eval()
    randomize_ssm_and_router(reference.language_model)
    reference.save_pretrained(path)
    return reference


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NemotronH_Omni_Reasoning_V3]:
    path = tmp_path_factory.mktemp("omni")
    return path, write_omni_checkpoint(path)


def test_omni_text_path_matches_transformers(
    omni: tuple[Path, NemotronH_Omni_Reasoning_V3],
) -> None:
    path, reference = omni
    on_disk = [name for name, _ in iter_checkpoint_tensors(path)]
    assert any(name.startswith("vision_model.") for name in on_disk)
    assert any(name.startswith("mlp1.") for name in on_disk)

    model, config = load_model(path)
    assert isinstance(model, NemotronVLForCausalLM)
    assert isinstance(model.language_model, NemotronHForCausalLM)
    assert config.architecture == "NemotronH_Omni_Reasoning_V3"
    prompts = prompts_of([14, 6], seed=4)
    trace = run_paged_generation(
        model, config.cache_spec(), prompts, chunk_size=5, decode_steps=DECODE_STEPS
    )
    assert_matches_reference(reference, prompts, trace, DECODE_STEPS)


@pytest.mark.parametrize("name", WRAPPER_NAMES)
def test_wrapper_names_share_one_class_with_backbone_preferences(name: str) -> None:
    assert model_class_for(name) is NemotronVLForCausalLM
    assert model_preferences(name) == model_preferences("NemotronHForCausalLM") == ("v2", "python")


def test_nano_vl_layout_loads_under_llm_config(
    omni: tuple[Path, NemotronH_Omni_Reasoning_V3], tmp_path: Path
) -> None:
    path, _ = omni
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["NemotronH_Nano_VL_V2"]
    raw["llm_config"] = raw.pop("text_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")

    model, config = load_model(tmp_path)
    reference, _ = load_model(path)
    assert isinstance(model, NemotronVLForCausalLM)
    assert config.architecture == "NemotronH_Nano_VL_V2"
    for (name, ours), (_, theirs) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_unknown_and_missing_tensors_are_named(
    omni: tuple[Path, NemotronH_Omni_Reasoning_V3],
) -> None:
    path, _ = omni
    model, _ = load_model(path)
    weights = [
        (name, tensor)
        for name, tensor in iter_checkpoint_tensors(path)
        if name != "language_model.backbone.norm_f.weight"
    ]
    weights.append(("audio_decoder.proj.weight", torch.zeros(2, 2)))
    with pytest.raises(CheckpointError) as err:
        model.load_weights(weights)
    message = str(err.value)
    assert "backbone.norm_f.weight" in message
    assert "audio_decoder.proj.weight" in message
    assert "vision_model" not in message
