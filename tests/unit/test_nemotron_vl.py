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

from models.config import ModelConfig
from models.errors import CheckpointError
from models.loader import iter_checkpoint_tensors, load_model
from models.nemotron_h import NemotronHForCausalLM
from models.nemotron_vl import NemotronVLForCausalLM
from models.registry import model_class_for, model_preferences
from tests.paged_harness import GenerationTrace, assert_matches_reference, run_paged_generation
from tests.unit.test_nemotron_h_parity import (
    DECODE_STEPS,
    VOCAB,
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


IMAGE_TOKEN_ID = 5


def image_prompt(grids: list[tuple[int, int]], seed: int) -> list[int]:
    """Text, then per image `<image>` x its token count between text tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(6, VOCAB, (3,), generator=gen).tolist()
    for rows, cols in grids:
        prompt += [IMAGE_TOKEN_ID] * (rows * cols // 4)
        prompt += torch.randint(6, VOCAB, (4,), generator=gen).tolist()
    return prompt


def image_inputs(grids: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grid_hw = torch.tensor(grids)
    return torch.randn(int(grid_hw.prod(-1).sum()), 3 * 4 * 4, generator=gen), grid_hw


def encode_images(
    model: NemotronVLForCausalLM, pixel_values: torch.Tensor, grids: list[tuple[int, int]]
) -> torch.Tensor:
    """The images' embeddings, in prompt order, through the wrapper's image path."""
    sizes = [rows * cols for rows, cols in grids]
    with torch.no_grad():
        return torch.cat(
            [
                model.encode_image(pixels, grid)
                for pixels, grid in zip(pixel_values.split(sizes), grids, strict=True)
            ]
        )


def generate_with_images(
    model: NemotronVLForCausalLM,
    config: ModelConfig,
    reference: NemotronH_Omni_Reasoning_V3,
    prompt: list[int],
    embeds: torch.Tensor,
    pixel_values: torch.Tensor,
    grid_hw: torch.Tensor,
) -> GenerationTrace:
    """`embeds` in place of the placeholders: prefill in chunks that split an
    image's tokens, then greedy decode; logits and tokens as transformers'."""
    positions = [p for p, token in enumerate(prompt) if token == IMAGE_TOKEN_ID]
    trace = run_paged_generation(
        model,
        config.cache_spec(),
        [prompt],
        chunk_size=5,
        decode_steps=DECODE_STEPS,
        embeds_at=[dict(zip(positions, embeds, strict=True))],
    )
    assert_matches_reference(
        reference,
        [prompt],
        trace,
        DECODE_STEPS,
        reference_inputs=[{"pixel_values": pixel_values, "image_grid_hw": grid_hw}],
    )
    return trace


@pytest.mark.parametrize("grids", [[(4, 6)], [(2, 4), (6, 2)]], ids=["one-image", "two-images"])
def test_images_match_transformers(
    omni: tuple[Path, NemotronH_Omni_Reasoning_V3], grids: list[tuple[int, int]]
) -> None:
    """Encoder output in place of the placeholders matches transformers."""
    path, reference = omni
    model, config = load_model(path)
    assert isinstance(model, NemotronVLForCausalLM)
    prompt = image_prompt(grids, seed=len(grids))
    pixel_values, grid_hw = image_inputs(grids, seed=3)
    embeds = encode_images(model, pixel_values, grids)
    trace = generate_with_images(model, config, reference, prompt, embeds, pixel_values, grid_hw)
    # The images matter: without them the answer differs.
    text_only = run_paged_generation(
        model, config.cache_spec(), [prompt], chunk_size=5, decode_steps=DECODE_STEPS
    )
    assert not torch.allclose(text_only.prompt_logits[0], trace.prompt_logits[0])


def test_transformers_names_load_the_same_image_path(
    omni: tuple[Path, NemotronH_Omni_Reasoning_V3],
) -> None:
    """transformers' in-memory names (separate q/k/v, multi_modal_projector)
    load into the same parameters as the release names on disk."""
    path, reference = omni
    model, _ = load_model(path)
    from_memory, _ = load_model(path)
    with torch.no_grad():
        for name, param in from_memory.named_parameters():
            if not name.startswith("language_model."):
                param.zero_()
    in_memory_names = [
        (name, tensor)
        for name, tensor in reference.state_dict().items()
        if not name.startswith("language_model.")
    ]
    assert any(".attention.q_proj." in name for name, _ in in_memory_names)
    assert any(name.startswith("multi_modal_projector.") for name, _ in in_memory_names)
    language = [
        (name, tensor)
        for name, tensor in iter_checkpoint_tensors(path)
        if name.startswith("language_model.")
    ]
    from_memory.load_weights(language + in_memory_names)
    for (name, ours), (_, theirs) in zip(
        model.state_dict().items(), from_memory.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name
