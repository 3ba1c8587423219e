"""Deterministic random weights under the checkpoints' real on-disk key names.

Weights come from the `transformers` model class of each architecture, built
from the config under `torch.manual_seed(seed)`, so they follow that class's own
initialization (`initializer_range` included) and load back without missing or
unexpected keys. The in-memory names are then mapped to the names released
checkpoints use on disk, which `transformers` converts back when loading:

    LlamaForCausalLM      model.layers.0.self_attn.q_proj.weight   (unchanged)
    NemotronHForCausalLM  model.*                     -> backbone.*
                          mixer.experts.up_proj [E,I,H] -> mixer.experts.{e}.up_proj.weight
                          mtp.layers.* drawn here (`models.embedded.mtp_weights`)
    VL / Omni wrappers    language_model.model.*      -> language_model.backbone.*
                          multi_modal_projector.{layer_norm,linear_1,linear_2} -> mlp1.{0,1,3}
                          vision_model.*              -> vision_model.radio_model.*
                          attention.{q,k,v}_proj      -> attn.qkv (concatenated on dim 0)
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from models.embedded.configs import VL_ARCHITECTURES, language_model_config
from models.embedded.mtp_weights import mtp_state_dict
from models.vl_names import release_name

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

_EXPERTS = re.compile(r"(?P<stem>.*\.mixer\.experts)\.(?P<proj>up_proj|down_proj)")


def build_model(config: dict[str, Any], seed: int) -> PreTrainedModel:
    """Instantiate the transformers class for `config` with weights drawn from `seed`.

    The global torch RNG is forked, so callers' random streams are untouched.
    """
    import torch

    config_class, model_class = _transformers_classes(config["architectures"][0])
    hf_config = config_class.from_dict(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(hf_config)
    return model.eval()


def build_state_dict(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """On-disk tensors (name -> contiguous tensor) of a checkpoint for `config`,
    the MTP layers' too when the language model config has them (which the
    transformers class does not build: `models.embedded.mtp_weights`)."""
    model = build_model(config, seed)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    architecture = config["architectures"][0]
    tensors = to_disk_names(architecture, state)
    prefix = "language_model." if architecture in VL_ARCHITECTURES else ""
    tensors.update(mtp_state_dict(language_model_config(config), seed, prefix))
    return tensors


def to_disk_names(architecture: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a transformers state dict to the key names released checkpoints use."""
    if architecture == "LlamaForCausalLM":
        return {name: tensor.contiguous() for name, tensor in state.items()}
    if architecture == "NemotronHForCausalLM":
        return _nemotron_h_disk_names(state, prefix="")
    if architecture in VL_ARCHITECTURES:
        return _vl_disk_names(state)
    raise ValueError(f"no on-disk naming rules for architecture {architecture!r}")


def _transformers_classes(architecture: str) -> tuple[Any, Any]:
    if architecture == "LlamaForCausalLM":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM
    if architecture == "NemotronHForCausalLM":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        return NemotronHConfig, NemotronHForCausalLM
    if architecture in VL_ARCHITECTURES:
        # Every wrapper composes the same parts (Nemotron-H language model,
        # RADIO tower, MLP projector); the transformers Omni class builds them.
        from transformers.models.nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3,
            NemotronH_Omni_Reasoning_V3_Config,
        )

        return NemotronH_Omni_Reasoning_V3_Config, NemotronH_Omni_Reasoning_V3
    raise ValueError(f"no transformers class for architecture {architecture!r}")


def _nemotron_h_disk_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`model.` -> `backbone.` and stacked MoE experts -> one tensor per expert."""
    out: dict[str, torch.Tensor] = {}
    inner = prefix + "model."
    for name, tensor in state.items():
        if name.startswith(inner):
            name = prefix + "backbone." + name[len(inner) :]
        match = _EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor.contiguous()
            continue
        for expert, weight in enumerate(tensor.unbind(0)):
            out[f"{match['stem']}.{expert}.{match['proj']}.weight"] = weight.contiguous()
    return out


def _vl_disk_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    language = {k: v for k, v in state.items() if k.startswith("language_model.")}
    out = _nemotron_h_disk_names(language, prefix="language_model.")
    qkv_parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.startswith("language_model."):
            continue
        disk_name, part = release_name(name)
        if part is None:
            out[disk_name] = tensor.contiguous()
        else:
            qkv_parts.setdefault(disk_name, {})[part] = tensor
    import torch

    for disk_name, parts in qkv_parts.items():
        out[disk_name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    return out
