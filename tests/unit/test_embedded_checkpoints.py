"""Embedded checkpoints load in transformers, generate, and are deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from models.embedded import (
    ARCHS,
    SIZES,
    VL_ARCHITECTURES,
    CheckpointWriteError,
    checkpoint_config,
    ensure_checkpoint,
    write_checkpoint,
)
from models.embedded.safetensors_file import write_safetensors
from models.embedded.tokenizer import SPECIAL_TOKEN_IDS, STOP_TOKEN_IDS, train_tokenizer
from models.embedded.weights import build_model

INIT = 0.1  # large enough that logits are not flat


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedded")
    return {
        "llama": write_checkpoint(root / "llama", "llama", seed=0, initializer_range=INIT),
        "nemotron_h": write_checkpoint(root / "nh", "nemotron_h", seed=0, initializer_range=INIT),
        "omni": write_checkpoint(
            root / "omni",
            "nemotron_vl",
            seed=0,
            vl_architecture="NemotronH_Omni_Reasoning_V3",
            initializer_range=INIT,
        ),
    }


def test_constants() -> None:
    assert ARCHS == ("llama", "nemotron_h", "nemotron_vl")
    assert SIZES == ("tiny", "small", "mini")
    assert "NemotronH_Nano_VL_V2" in VL_ARCHITECTURES


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_causal_lm_loads_with_all_keys_and_generates(
    checkpoints: dict[str, Path], arch: str
) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(checkpoints[arch], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    # The on-disk names map back onto exactly the tensors the seeded class drew.
    config = json.loads((checkpoints[arch] / "config.json").read_text())
    expected = build_model(config, seed=0).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    prompt = torch.tensor([[1, 40, 41, 42, 43]])
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 11)
    logits = model(prompt).logits[0, -1]
    assert logits.std() > 0.05  # initializer_range 0.1 gives non-flat logits


def test_tokenizer_round_trips_and_has_chat_template(checkpoints: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama"])
    assert len(tokenizer) == 512
    text = "The clockmaker fixed 12 watches.\n  Ünïcode ✓ 你好"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == SPECIAL_TOKEN_IDS["<s>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = [{"role": "user", "content": "Hello there"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert encoded[:2] == [SPECIAL_TOKEN_IDS["<s>"], SPECIAL_TOKEN_IDS["<|im_start|>"]]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == SPECIAL_TOKEN_IDS["<|im_end|>"]


def test_generation_config_lists_stop_tokens(checkpoints: dict[str, Path]) -> None:
    generation = json.loads((checkpoints["nemotron_h"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(STOP_TOKEN_IDS)
    assert generation["bos_token_id"] == 1 and generation["pad_token_id"] == 0


def test_nemotron_h_uses_backbone_prefix_and_per_expert_tensors(
    checkpoints: dict[str, Path],
) -> None:
    config = json.loads((checkpoints["nemotron_h"] / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    pattern = config["hybrid_override_pattern"]
    assert set(pattern) == {"M", "*", "-", "E"}
    moe_layer = pattern.index("E")
    with safe_open(checkpoints["nemotron_h"] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert all(k.startswith(("backbone.", "lm_head.")) for k in keys)
    for expert in range(config["n_routed_experts"]):
        for proj in ("up_proj", "down_proj"):
            assert f"backbone.layers.{moe_layer}.mixer.experts.{expert}.{proj}.weight" in keys
    assert f"backbone.layers.{moe_layer}.mixer.shared_experts.up_proj.weight" in keys


def test_omni_checkpoint_loads_in_transformers_omni_class(checkpoints: dict[str, Path]) -> None:
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    path = checkpoints["omni"]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["NemotronH_Omni_Reasoning_V3"]
    assert config["llm_config"]["architectures"] == ["NemotronHForCausalLM"]
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.backbone.embeddings.weight" in keys
    assert "language_model.lm_head.weight" in keys
    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    out = model.generate(torch.tensor([[1, 50, 60, 70]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


def test_vl_checkpoint_image_path_matches_transformers(checkpoints: dict[str, Path]) -> None:
    """The written vision tower and projector load into our wrapper, and an image
    preprocessed per the written preprocessor_config.json embeds as transformers'."""
    from PIL import Image
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from models.image_processing import load_image_processor_config, preprocess_image
    from models.loader import load_model

    path = checkpoints["omni"]
    ours, config = load_model(path)
    assert config.vision is not None
    processing = load_image_processor_config(path, config.vision)
    grid = processing.patch_grid(100, 60)
    assert config.vision.num_image_tokens(grid) <= 16  # the tiny budget
    pixels = torch.randint(0, 256, (100, 60, 3), generator=torch.Generator().manual_seed(0))
    pixel_values = preprocess_image(Image.fromarray(pixels.byte().numpy()), grid, processing)
    reference = NemotronH_Omni_Reasoning_V3.from_pretrained(path).eval()
    with torch.no_grad():
        expected = reference.get_image_features(pixel_values, torch.tensor([grid])).pooler_output
        embeds = ours.encode_image(pixel_values, grid)  # type: ignore[operator]
    assert embeds.shape == (config.vision.num_image_tokens(grid), config.hidden_size)
    torch.testing.assert_close(embeds, expected[0], rtol=0, atol=1e-5)


def test_vl_default_wrapper_nests_llm_config() -> None:
    config = checkpoint_config("nemotron_vl")
    assert config["architectures"] == ["NemotronH_Nano_VL_V2"]
    llm = config["llm_config"]
    assert llm == checkpoint_config("nemotron_h")
    assert config["vision_config"]["model_type"] == "radio"
    with pytest.raises(ValueError, match="vl_architecture"):
        checkpoint_config("nemotron_vl", vl_architecture="NoSuchWrapper")
    with pytest.raises(ValueError, match="only meaningful"):
        checkpoint_config("llama", vl_architecture="NemotronH_Nano_VL_V2")


def test_same_seed_is_byte_identical_and_seed_matters(tmp_path: Path) -> None:
    first = write_checkpoint(tmp_path / "a", "nemotron_h", seed=7)
    again = write_checkpoint(tmp_path / "b", "nemotron_h", seed=7)
    other = write_checkpoint(tmp_path / "c", "nemotron_h", seed=8)
    data = (first / "model.safetensors").read_bytes()
    assert data == (again / "model.safetensors").read_bytes()
    assert data != (other / "model.safetensors").read_bytes()


def test_initializer_range_sets_weight_scale(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "wide", "llama", initializer_range=0.1)
    narrow = checkpoint_config("llama")
    assert narrow["initializer_range"] == 0.02
    wide_q = load_file(path / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    narrow_q = build_model(narrow, seed=0).state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert wide_q.std().item() == pytest.approx(0.1, rel=0.1)
    assert narrow_q.std().item() == pytest.approx(0.02, rel=0.1)


def test_small_llama_is_compute_sized() -> None:
    config = checkpoint_config("llama", "small")
    assert config["hidden_size"] == 512
    assert config["num_hidden_layers"] >= 8
    assert config["vocab_size"] >= 4096
    assert train_tokenizer(config["vocab_size"]).get_vocab_size() == config["vocab_size"]
    hybrid = checkpoint_config("nemotron_h", "small")
    assert hybrid["hidden_size"] == 512 and len(hybrid["hybrid_override_pattern"]) >= 8


def test_ensure_checkpoint_writes_only_when_needed(tmp_path: Path) -> None:
    out = ensure_checkpoint(tmp_path / "ck", "llama", "tiny")
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    ensure_checkpoint(out, "llama", "tiny")
    assert weights.stat().st_mtime_ns == stamp
    (out / "tokenizer.json").unlink()
    ensure_checkpoint(out, "llama", "tiny")
    assert (out / "tokenizer.json").is_file()
    ensure_checkpoint(out, "nemotron_h", "tiny")  # different arch: rewritten
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron_h"


def test_write_into_existing_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(CheckpointWriteError, match="existing file"):
        write_checkpoint(target, "llama")


def test_safetensors_writer_matches_reference_reader(tmp_path: Path) -> None:
    tensors = {
        "b.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "a.f32": torch.randn(2, 3, 4),
        "c.i64": torch.arange(6),
        "d.bool": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5),
        "f.strided": torch.randn(4, 6).t(),
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_small_llama_checkpoint_matches_its_config(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "small", "llama", size="small")
    config = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        embed = f.get_slice("model.embed_tokens.weight").get_shape()
        names: list[str] = list(f.keys())
    layers = {k.split(".")[2] for k in names if k.startswith("model.layers.")}
    assert embed == [config["vocab_size"], config["hidden_size"]] == [4096, 512]
    assert len(layers) == config["num_hidden_layers"] >= 8
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == config["vocab_size"]
