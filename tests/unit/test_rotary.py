"""RoPE inverse frequencies against transformers' ROPE_INIT_FUNCTIONS, and rotation."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.config import RopeConfig
from models.hf_config import parse_model_config
from models.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

MAX_POSITIONS = 64
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def hf_config(rope: dict[str, object]) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_theta": 500000.0, **rope},
    )


@pytest.mark.parametrize("rope_type", sorted(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 4 * MAX_POSITIONS])
def test_inv_freq_matches_transformers(rope_type: str, seq_len: int | None) -> None:
    config = hf_config(SCALINGS[rope_type])
    expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len)
    ours = parse_model_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert ours.rope is not None and ours.rope.scaling_type == rope_type
    inv_freq = compute_inv_freq(ours.rope, ours.head_dim, MAX_POSITIONS, seq_len)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0.0)


def test_dynamic_rope_rescales_only_past_the_trained_context() -> None:
    ours = parse_model_config(
        {**hf_config(SCALINGS["dynamic"]).to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    assert ours.rope is not None
    rotary = RotaryEmbedding(ours.head_dim, ours.rope, MAX_POSITIONS)
    inside = rotary.cos_sin(torch.arange(MAX_POSITIONS), torch.float32)
    past = rotary.cos_sin(torch.arange(2 * MAX_POSITIONS), torch.float32)
    default = RotaryEmbedding(ours.head_dim, RopeConfig(theta=ours.rope.theta), MAX_POSITIONS)
    torch.testing.assert_close(inside, default.cos_sin(torch.arange(MAX_POSITIONS), torch.float32))
    assert not torch.allclose(past[0][:MAX_POSITIONS], inside[0])


def test_rotation_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ours = parse_model_config(
        {**hf_config({"rope_type": "default"}).to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    assert ours.rope is not None
    rotary = RotaryEmbedding(ours.head_dim, ours.rope, MAX_POSITIONS)
    positions = torch.tensor([0, 3, 17, 40])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    q = torch.randn(4, 4, ours.head_dim)
    k = torch.randn(4, 2, ours.head_dim)
    # transformers: [batch, heads, seq, dim] with cos/sin [batch, seq, dim]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("rope_type", ["default", *sorted(SCALINGS)])
def test_table_rows_are_the_values_computed_per_step(rope_type: str) -> None:
    config = hf_config(SCALINGS.get(rope_type, {"rope_type": "default"}))
    ours = parse_model_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert ours.rope is not None
    rotary = RotaryEmbedding(ours.head_dim, ours.rope, MAX_POSITIONS)
    for seq_len in (MAX_POSITIONS // 2, MAX_POSITIONS):  # the second may grow the table
        positions = torch.randint(0, seq_len, (40,))
        for dtype in (torch.float32, torch.bfloat16):
            direct = RotaryEmbedding(ours.head_dim, ours.rope, MAX_POSITIONS).cos_sin(
                positions, dtype
            )
            tabled = rotary.cos_sin(positions, dtype, seq_len)
            assert all(torch.equal(a, b) for a, b in zip(tabled, direct, strict=True))


def test_table_grows_past_its_first_length() -> None:
    rotary = RotaryEmbedding(64, RopeConfig(theta=10000.0), 1 << 20)
    positions = torch.tensor([0, 5000, 9999, 20000])
    tabled = rotary.cos_sin(positions, torch.float32, seq_len=20001)
    direct = rotary.cos_sin(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(tabled, direct, strict=True))
    assert rotary.cos_sin(positions[:2], torch.float32, seq_len=5001)[0].shape == (2, 64)


def test_dynamic_scaling_past_the_trained_context_skips_the_table() -> None:
    ours = parse_model_config(
        {**hf_config(SCALINGS["dynamic"]).to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    assert ours.rope is not None
    rotary = RotaryEmbedding(ours.head_dim, ours.rope, MAX_POSITIONS)
    positions = torch.arange(2 * MAX_POSITIONS)
    rotary.cos_sin(positions[:MAX_POSITIONS], torch.float32, MAX_POSITIONS)  # fills the table
    past = rotary.cos_sin(positions, torch.float32, 2 * MAX_POSITIONS)
    expected = rotary.cos_sin(positions, torch.float32)  # reads the longest position back
    assert all(torch.equal(a, b) for a, b in zip(past, expected, strict=True))
    inside = rotary.cos_sin(positions[:MAX_POSITIONS], torch.float32, MAX_POSITIONS)
    assert not torch.equal(past[0][:MAX_POSITIONS], inside[0])
