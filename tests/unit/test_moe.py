"""Nemotron-H MoE against a naive per-token loop and against transformers' module."""

from __future__ import annotations

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from models.config import MoEConfig
from models.layers.moe import NemotronHMoE
from models.layers.relu2_mlp import Relu2MLP, relu2

HIDDEN = 32


def moe_config(**overrides: object) -> MoEConfig:
    fields: dict[str, object] = {
        "num_experts": 8,
        "top_k": 2,
        "intermediate_size": 24,
        "shared_intermediate_size": 40,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    }
    fields.update(overrides)
    return MoEConfig(**fields)  # type: ignore[arg-type]


def random_moe(config: MoEConfig, seed: int = 0) -> NemotronHMoE:
    torch.manual_seed(seed)
    moe = NemotronHMoE(HIDDEN, config)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    return moe


def naive_moe(moe: NemotronHMoE, config: MoEConfig, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, with Python sorting for every selection."""
    gate = moe.gate
    per_group = config.num_experts // config.n_group
    rows = []
    for token in x:
        scores = torch.sigmoid(gate.weight @ token)
        choice = (scores + gate.e_score_correction_bias).tolist()
        group_score = [
            sum(sorted(choice[g * per_group : (g + 1) * per_group], reverse=True)[:2])
            for g in range(config.n_group)
        ]
        groups = sorted(range(config.n_group), key=lambda g: -group_score[g])[: config.topk_group]
        candidates = [e for e in range(config.num_experts) if e // per_group in groups]
        chosen = sorted(candidates, key=lambda e: -choice[e])[: config.top_k]
        weights = [scores[e].item() for e in chosen]
        if config.norm_topk_prob:
            weights = [w / sum(weights) for w in weights]
        out = torch.zeros(HIDDEN)
        for e, w in zip(chosen, weights, strict=True):
            expert = moe.experts[e]
            assert isinstance(expert, Relu2MLP)
            out += w * config.routed_scaling_factor * expert.down_proj(relu2(expert.up_proj(token)))
        if moe.shared_experts is not None:
            out += moe.shared_experts(token)
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_group": 1, "topk_group": 1, "top_k": 3, "norm_topk_prob": False},
        {"shared_intermediate_size": 0, "routed_scaling_factor": 1.0},
    ],
)
def test_moe_matches_naive_per_token_loop(overrides: dict[str, object]) -> None:
    config = moe_config(**overrides)
    moe = random_moe(config)
    x = torch.randn(13, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), naive_moe(moe, config, x), rtol=1e-5, atol=1e-5)


def test_correction_bias_steers_selection_but_not_weights() -> None:
    config = moe_config(
        n_group=1, topk_group=1, top_k=1, routed_scaling_factor=1.0, norm_topk_prob=False
    )
    moe = random_moe(config)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[6] = 100.0
        experts, weights = moe.gate(x)
    assert experts.flatten().tolist() == [6] * 5
    expected = torch.sigmoid(x @ moe.gate.weight[6])
    torch.testing.assert_close(weights.flatten(), expected)


def test_moe_matches_transformers_module() -> None:
    config = moe_config()
    moe = random_moe(config, seed=3)
    reference = hf.NemotronHMoE(
        NemotronHConfig(
            hidden_size=HIDDEN,
            layers_block_type=["moe"],
            n_routed_experts=config.num_experts,
            num_experts_per_tok=config.top_k,
            moe_intermediate_size=config.intermediate_size,
            moe_shared_expert_intermediate_size=config.shared_intermediate_size,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
        )
    ).eval()
    # transformers stacks the per-expert tensors of the checkpoint.
    ours = moe.state_dict()
    stacked = {
        f"experts.{proj}": torch.stack(
            [ours[f"experts.{e}.{proj}.weight"] for e in range(config.num_experts)]
        )
        for proj in ("up_proj", "down_proj")
    }
    shared = {k: v for k, v in ours.items() if not k.startswith("experts.")}
    reference.load_state_dict({**shared, **stacked})

    x = torch.randn(17, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference(x), rtol=1e-5, atol=1e-5)


def test_router_stays_float32_in_a_bfloat16_model() -> None:
    moe = random_moe(moe_config()).to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.up_weights.dtype == moe.down_weights.dtype == torch.bfloat16
    out = moe(torch.randn(4, HIDDEN, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_groups_of_one_expert_are_refused() -> None:
    with pytest.raises(ValueError, match="lower n_group"):
        NemotronHMoE(HIDDEN, moe_config(n_group=8, topk_group=2))
