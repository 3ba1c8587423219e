"""Seeded random multi-token-prediction tensors of a Nemotron-H checkpoint.

transformers' Nemotron-H builds no MTP layers (it ignores `mtp.*` when
loading), so the embedded writer draws them itself, in the layout released
checkpoints ship (one layer per character of `mtp_hybrid_override_pattern`,
pattern "*E"):

    mtp.layers.0.enorm.weight, hnorm.weight       [hidden]
    mtp.layers.0.eh_proj.weight                    [hidden, 2 * hidden]
    mtp.layers.0.norm.weight                       [hidden]
    mtp.layers.0.mixer.{q,k,v,o}_proj.weight       as a backbone attention layer's
    mtp.layers.1.norm.weight                       [hidden]
    mtp.layers.1.mixer.gate.weight, gate.e_score_correction_bias
    mtp.layers.1.mixer.experts.{e}.{up,down}_proj.weight
    mtp.layers.1.mixer.shared_experts.{up,down}_proj.weight
    mtp.layers.1.final_layernorm.weight            [hidden]

Initialized as transformers initializes the backbone: norms one, the router's
correction bias zero, every other weight normal with std `initializer_range`.
The draws come from their own generator, so a checkpoint's backbone tensors
are the same with and without its MTP layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MTP_PREFIX = "mtp.layers."
# Added to the checkpoint seed: the MTP draws never replay the backbone's.
_SEED_OFFSET = 7_340_033


def mtp_shapes(llm: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name (under `mtp.layers.`) -> shape of every MTP tensor of the
    language model config `llm` (a Nemotron-H config.json body)."""
    pattern = llm["mtp_hybrid_override_pattern"]
    hidden = llm["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i, char in enumerate(pattern):
        layer = f"{i}."
        if i == 0:
            shapes[layer + "enorm.weight"] = (hidden,)
            shapes[layer + "hnorm.weight"] = (hidden,)
            shapes[layer + "eh_proj.weight"] = (hidden, 2 * hidden)
        shapes[layer + "norm.weight"] = (hidden,)
        for name, shape in _mixer_shapes(llm, char).items():
            shapes[f"{layer}mixer.{name}"] = shape
        if i == len(pattern) - 1:
            shapes[layer + "final_layernorm.weight"] = (hidden,)
    return shapes


def _mixer_shapes(llm: dict[str, Any], char: str) -> dict[str, tuple[int, ...]]:
    hidden = llm["hidden_size"]
    if char == "*":
        q = llm["num_attention_heads"] * llm["head_dim"]
        kv = llm["num_key_value_heads"] * llm["head_dim"]
        return {
            "q_proj.weight": (q, hidden),
            "k_proj.weight": (kv, hidden),
            "v_proj.weight": (kv, hidden),
            "o_proj.weight": (hidden, q),
        }
    if char == "-":
        width = llm["intermediate_size"]
        return {"up_proj.weight": (width, hidden), "down_proj.weight": (hidden, width)}
    if char != "E":
        raise ValueError(f"MTP layers are *, - or E; mtp_hybrid_override_pattern has {char!r}")
    experts, width = llm["n_routed_experts"], llm["moe_intermediate_size"]
    shared = llm["moe_shared_expert_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "gate.weight": (experts, hidden),
        "gate.e_score_correction_bias": (experts,),
    }
    for e in range(experts):
        shapes[f"experts.{e}.up_proj.weight"] = (width, hidden)
        shapes[f"experts.{e}.down_proj.weight"] = (hidden, width)
    shapes["shared_experts.up_proj.weight"] = (shared, hidden)
    shapes["shared_experts.down_proj.weight"] = (hidden, shared)
    return shapes


def mtp_state_dict(llm: dict[str, Any], seed: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """The MTP tensors of `llm`, named `{prefix}mtp.layers.*`; empty without
    `num_nextn_predict_layers`."""
    import torch

    if not llm.get("num_nextn_predict_layers"):
        return {}
    std = llm.get("initializer_range", 0.02)
    gen = torch.Generator().manual_seed(seed + _SEED_OFFSET)
    out: dict[str, torch.Tensor] = {}
    for name, shape in mtp_shapes(llm).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            tensor = torch.zeros(shape)
        else:
            tensor = torch.randn(shape, generator=gen) * std
        out[prefix + MTP_PREFIX + name] = tensor
    return out
