"""Checkpoint loading: single file, shards, dtypes, and precise mismatch errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from models.errors import CheckpointError, ConfigError
from models.loader import INDEX_FILE, SINGLE_FILE, checkpoint_files, load_model


def tiny_llama(**overrides: object) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    fields: dict[str, object] = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 128,
        "initializer_range": 0.1,
    }
    fields.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()


@pytest.fixture(scope="module")
def reference() -> transformers.LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def checkpoint(tmp_path: Path, reference: transformers.LlamaForCausalLM) -> Path:
    reference.save_pretrained(tmp_path)
    return tmp_path


def rewrite_weights(folder: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Replace (tensor) or drop (None) tensors of a single-file checkpoint."""
    path = folder / SINGLE_FILE
    tensors = load_file(path)
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ours = dict(model.named_parameters())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours[name].float(), tensor.float()), name


def test_single_file_loads_every_tensor(
    checkpoint: Path, reference: transformers.LlamaForCausalLM
) -> None:
    model, config = load_model(checkpoint)
    assert config.dtype == "float32" and not model.training
    assert_same_weights(model, reference)
    # The loader ran the model's post-load step: Llama's fused projections
    # and prepacked head are built from (and current with) the loaded weights.
    assert model.logits_head is not None and model.logits_head.is_current()
    attention = model.model.layers[0].self_attn
    assert attention.qkv is not None and attention.qkv.is_current()


def test_wrong_shape_names_tensor_and_shapes(checkpoint: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_weights(checkpoint, {name: torch.zeros(8, 32)})
    with pytest.raises(
        CheckpointError, match=rf"{name}: expected shape \(16, 32\), found \(8, 32\)"
    ):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite_weights(checkpoint, {name: None})
    with pytest.raises(CheckpointError, match=rf"missing tensors: {name}"):
        load_model(checkpoint)


def test_unexpected_tensor_is_named(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, {"model.layers.2.mlp.up_proj.weight": torch.zeros(64, 32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.2\.mlp"):
        load_model(checkpoint)


def test_sharded_checkpoint(tmp_path: Path, reference: transformers.LlamaForCausalLM) -> None:
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    files = checkpoint_files(tmp_path)
    assert (tmp_path / INDEX_FILE).is_file() and len(files) > 1
    model, _ = load_model(tmp_path)
    assert_same_weights(model, reference)


def test_index_listing_absent_shard(
    tmp_path: Path, reference: transformers.LlamaForCausalLM
) -> None:
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    absent = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / absent).unlink()
    with pytest.raises(CheckpointError, match=absent):
        load_model(tmp_path)


def test_bf16_checkpoint_loads_in_its_dtype_or_upcast(tmp_path: Path) -> None:
    reference = tiny_llama().to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_same_weights(model, reference)
    upcast, upcast_config = load_model(tmp_path, dtype=torch.float32)
    assert upcast_config.dtype == "float32" and upcast_config.cache_spec().dtype == "float32"
    assert {p.dtype for p in upcast.parameters()} == {torch.float32}
    assert_same_weights(upcast, reference)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    reference = tiny_llama(tie_word_embeddings=True)
    reference.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    lm_head = model.get_submodule("lm_head")
    embed = model.get_submodule("model.embed_tokens")
    assert lm_head.weight.data_ptr() == embed.weight.data_ptr()
    assert torch.equal(lm_head.weight, reference.lm_head.weight)


def test_folder_without_weights(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    empty = tmp_path_factory.mktemp("no-weights")
    shutil.copy(checkpoint / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(empty)


def test_unsupported_dtype(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="float64"):
        load_model(checkpoint, dtype="float64")
