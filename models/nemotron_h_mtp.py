"""Nemotron-H multi-token prediction (MTP): the checkpoint's `mtp.*` layers.

At position p the MTP takes the embedding of the token at p + 1 and the
target's hidden state at p (the backbone output after `norm_f`) and returns
a hidden state whose logits (the backbone's `lm_head`) predict the token at
p + 2. That output is also the next chained draft step's target hidden.

One layer per character of `mtp_hybrid_override_pattern` (`*` attention, `E`
MoE, `-` MLP), each named like a backbone layer of its kind (`norm`,
`mixer.*`). The first layer also fuses its two inputs, the last one ends with
a norm; in between the layers pass a separate residual stream, in the order
of vLLM's `nemotron_h_mtp.py` (pattern "*E"):

    x        = eh_proj(cat[enorm(embed(token)), hnorm(target_hidden)])   layer 0 only
    layer 0:   residual = x;              h = attention(norm(residual))
    layer 1:   residual = h + residual;   h = moe(norm(residual))
    out      = final_layernorm(h + residual)                             last layer only

The embedding and `lm_head` are the backbone's: the checkpoint ships no
copies. Attention layer j of the MTP reads and writes the paged KV of cache
ordinal `num backbone attention layers + j` (`ModelConfig.cache_spec` with
`use_mtp`), so its K/V lives in the request's blocks beside the backbone's.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.views import CacheViews
from models.batch import ForwardBatch
from models.config import ATTENTION, KV_LAYER_KINDS, MAMBA, ModelConfig
from models.errors import ConfigError
from models.layers.norm import RMSNorm
from models.nemotron_h_block import NemotronHLayer

MTP_PREFIX = "mtp."
# vLLM's NemotronHMTP also runs exactly one MTP step.
SUPPORTED_MTP_STEPS = 1


class NemotronHMTPLayer(NemotronHLayer):
    """A layer that passes `(hidden, residual)` on, as vLLM's decoder layers
    do; the first also owns the input fusion (`enorm`, `hnorm`, `eh_proj`),
    the last the `final_layernorm`."""

    def __init__(
        self, config: ModelConfig, kind: str, ordinal: int, first: bool, last: bool
    ) -> None:
        super().__init__(config, kind, ordinal)
        self.first = first
        self.last = last
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if first:
            self.enorm = RMSNorm(hidden, eps)
            self.hnorm = RMSNorm(hidden, eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        if last:
            self.final_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        caches: CacheViews,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(hidden, residual)` after this layer; the last returns `(out, None)`."""
        if self.first:
            fused = torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1)
            hidden = self.eh_proj(fused)
        if residual is None:
            residual = hidden
            x = self.norm(hidden)
        else:
            x, residual = self.norm.add_and_norm(hidden, residual)
        hidden = self.mix(x, batch, caches)
        if self.last:
            return self.final_layernorm(hidden + residual), None
        return hidden, residual


class NemotronHMTP(nn.Module):
    """The MTP layers of a Nemotron-H (checkpoint prefix `mtp.`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_mtp_config(config)
        kinds = config.mtp_layer_types
        # Cache ordinals of the MTP attention layers follow the backbone's.
        attention_ordinal = len(config.layers_of(*KV_LAYER_KINDS))
        layers = []
        for i, kind in enumerate(kinds):
            layers.append(
                NemotronHMTPLayer(
                    config, kind, attention_ordinal, first=i == 0, last=i == len(kinds) - 1
                )
            )
            if kind == ATTENTION:
                attention_ordinal += 1
        self.layers = nn.ModuleList(layers)

    def forward(
        self,
        embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        batch: ForwardBatch,
        caches: CacheViews,
    ) -> torch.Tensor:
        """Output hidden states `[T, hidden]` for the next tokens' embeddings
        `embeds` and the target's hidden states `target_hidden`, both `[T, hidden]`,
        row t at `batch.positions[t]`. Writes the MTP attention layers' K/V
        there through `batch.slot_mapping`."""
        hidden, residual = target_hidden, None
        for layer in self.layers:
            hidden, residual = layer(embeds, hidden, residual, batch, caches)
        return hidden


def check_mtp_config(config: ModelConfig) -> None:
    """Raise `ConfigError` unless `config` describes MTP layers this module builds."""
    if config.num_nextn_predict_layers == 0 or not config.mtp_layer_types:
        raise ConfigError(
            f"{config.architecture}: num_nextn_predict_layers is "
            f"{config.num_nextn_predict_layers}: the checkpoint has no MTP layers to draft with"
        )
    if config.num_nextn_predict_layers != SUPPORTED_MTP_STEPS:
        raise ConfigError(
            f"{config.architecture}: num_nextn_predict_layers is "
            f"{config.num_nextn_predict_layers}; MTP drafting supports checkpoints with "
            f"exactly {SUPPORTED_MTP_STEPS} MTP step"
        )
    if MAMBA in config.mtp_layer_types:
        raise ConfigError(
            f"{config.architecture}: the MTP layers hold a Mamba layer (M in "
            "mtp_hybrid_override_pattern); MTP layers may be * (attention), - (mlp), E (moe)"
        )
