"""The byte counts of `benchmarks.mtp_kv`: what sending the MTP K/V adds to
a prompt's transfer, and what recomputing it would need instead."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.mtp_kv import BLOCK_SIZE, prompt_bytes
from models.config import ModelConfig
from models.embedded.writer import ensure_checkpoint
from models.hf_config import load_model_config


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    path: Path = ensure_checkpoint(
        tmp_path_factory.mktemp("mtp") / "nh", "nemotron_h", "tiny", mtp=True
    )
    return load_model_config(path)


def test_the_mtp_kv_is_one_attention_layer_per_block_of_the_prompt(config: ModelConfig) -> None:
    sizes = prompt_bytes(config, 3 * BLOCK_SIZE + 1)  # 4 blocks
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    assert sizes.mtp_kv == 4 * BLOCK_SIZE * per_token
    backbone_attention = config.cache_spec().num_attention_layers
    assert sizes.cache == backbone_attention * sizes.mtp_kv
    assert sizes.hidden == (3 * BLOCK_SIZE + 1) * config.hidden_size * 4


def test_a_bfloat16_checkpoint_halves_every_count(config: ModelConfig) -> None:
    full = prompt_bytes(config, 100)
    half = prompt_bytes(replace(config, dtype="bfloat16"), 100)
    assert (half.cache, half.mtp_kv, half.hidden) == (
        full.cache // 2,
        full.mtp_kv // 2,
        full.hidden // 2,
    )
