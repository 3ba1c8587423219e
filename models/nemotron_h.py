"""Nemotron-H: a hybrid decoder of Mamba2, attention, MLP and MoE layers.

Every layer is the same pre-norm residual block, `x + mixer(norm(x))`, whose
mixer is chosen by `config.layer_types[i]` (the checkpoint's pattern letter):

    "mamba"     M  Mamba2 mixer, state in a Mamba slot      (models/layers/mamba2.py)
    "attention" *  GQA attention over the paged KV cache, no positional encoding
    "mlp"       -  relu² MLP                                 (models/layers/relu2_mlp.py)
    "moe"       E  routed relu² experts + shared expert      (models/layers/moe.py)

Attention carries no RoPE: transformers' `NemotronHAttention` applies none
(the Mamba layers order the tokens), so `batch.positions` is unused here.

Module names follow the checkpoint: `backbone.embeddings`,
`backbone.layers.N.{norm,mixer.*}`, `backbone.norm_f`, `lm_head`. Per-expert
tensors stay per expert (`mixer.experts.N.{up,down}_proj.weight`), as on disk.
Also accepted when loading: transformers' in-memory prefix `model.` for
`backbone.`; skipped: multi-token-prediction tensors (`mtp.*`), which
transformers ignores too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from kvcache.views import AttentionLayerCache, CacheViews
from models.base import CausalLM
from models.batch import ForwardBatch
from models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from models.errors import ConfigError
from models.kernels import dispatch
from models.layers.attention import paged_attention
from models.layers.mamba2 import Mamba2Mixer
from models.layers.moe import NemotronHMoE
from models.layers.norm import RMSNorm
from models.layers.relu2_mlp import Relu2MLP
from models.layers.vocab_parallel import VocabParallelEmbedding
from models.sharding import vocab_rows_per_rank
from models.tensor_parallel import all_reduce, gather_vocab

HYBRID_LAYER_KINDS = (MAMBA, ATTENTION, MLP, MOE)
_SKIPPED_PREFIXES = ("mtp.",)


class NemotronHAttention(nn.Module):
    """GQA self-attention without positional encoding; K/V live in the paged cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # transformers builds these without bias whatever `attention_bias` says.
        self.q_proj = nn.Linear(hidden, q_size, bias=False)
        self.k_proj = nn.Linear(hidden, kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, layer_cache: AttentionLayerCache
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, layer_cache, batch, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class NemotronHBlock(nn.Module):
    """`x + mixer(norm(x))`; `ordinal` indexes this layer's cache among its kind."""

    def __init__(self, config: ModelConfig, kind: str, ordinal: int) -> None:
        super().__init__()
        self.kind = kind
        self.ordinal = ordinal
        self.tp = config.tp  # every mixer's output is a partial sum across ranks
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = _build_mixer(config, kind)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, caches: CacheViews
    ) -> torch.Tensor:
        x = self.norm(hidden)
        if self.kind == MAMBA:
            out = self.mixer(x, batch, caches.mamba[self.ordinal])
        elif self.kind == ATTENTION:
            out = self.mixer(x, batch, caches.attention[self.ordinal])
        elif self.kind == MOE:
            # On a GPU (or where its kernels are forced, as in tests) a decode
            # step must not read the routing back: that stalls the stream and
            # breaks graph capture. On CPU the chosen-experts loop costs less.
            sync_free = batch.is_decode_only and dispatch.use_triton(x.device)
            out = self.mixer(x, sync_free=sync_free)
        else:
            out = self.mixer(x)
        return hidden + all_reduce(out, self.tp)


def _build_mixer(config: ModelConfig, kind: str) -> nn.Module:
    if kind == MAMBA:
        if config.mamba is None:
            raise ConfigError(f"{config.architecture}: a mamba layer needs the mamba settings")
        return Mamba2Mixer(config.hidden_size, config.mamba)
    if kind == ATTENTION:
        return NemotronHAttention(config)
    if kind == MLP:
        return Relu2MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
    if config.moe is None:
        raise ConfigError(f"{config.architecture}: a moe layer needs the MoE settings")
    return NemotronHMoE(config.hidden_size, config.moe, shared_bias=config.mlp_bias)


class NemotronHBackbone(nn.Module):
    """Embedding, the hybrid layers and the final norm (checkpoint prefix `backbone.`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.tp)
        seen = {kind: 0 for kind in HYBRID_LAYER_KINDS}
        blocks = []
        for kind in config.layer_types:
            blocks.append(NemotronHBlock(config, kind, seen[kind]))
            seen[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        hidden = batch.input_embeddings(self.embeddings)
        for block in self.layers:
            hidden = block(hidden, batch, caches)
        return self.norm_f(hidden)


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H over the paged KV cache and the Mamba slot pool.

    Prefers the V2 block-major cache manager (attention blocks and Mamba slots
    each one contiguous region) and the Python transceiver (hybrid layouts are
    moved as per-(layer, block) and per-slot segments).
    """

    preferred_kv_manager: ClassVar[str | None] = "v2"
    preferred_transceiver: ClassVar[str | None] = "python"
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        _check_config(config)
        self.backbone = NemotronHBackbone(config)
        # Never shared with the embedding: transformers' Nemotron-H keeps (and
        # saves) its own lm_head even under tie_word_embeddings; see load_weights.
        # This rank's vocab rows (all of them with one rank).
        rows = vocab_rows_per_rank(config.vocab_size, config.tp.size)
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.num_attention_layers = len(config.layers_of(ATTENTION))
        self.num_mamba_layers = len(config.layers_of(MAMBA))

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        if (len(caches.attention), len(caches.mamba)) != (
            self.num_attention_layers,
            self.num_mamba_layers,
        ):
            raise ValueError(
                f"expected {self.num_attention_layers} attention and {self.num_mamba_layers} "
                f"mamba cache views, got {len(caches.attention)} and {len(caches.mamba)}"
            )
        return self.backbone(batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(self.lm_head(hidden), self.config.tp, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load by checkpoint name; with `tie_word_embeddings` and no `lm_head.weight`
        on disk, the head is a copy of the embedding."""
        if self.config.tie_word_embeddings:
            weights = self._with_tied_head(weights)
        super().load_weights(weights)

    def _with_tied_head(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        embedding, has_head = None, False
        for disk_name, tensor in weights:
            name = self.checkpoint_name(disk_name)
            has_head |= name == "lm_head.weight"
            if name == "backbone.embeddings.weight":
                embedding = tensor
            yield disk_name, tensor
        if embedding is not None and not has_head:
            yield "lm_head.weight", embedding

    def checkpoint_name(self, disk_name: str) -> str | None:
        if disk_name.startswith(_SKIPPED_PREFIXES):
            return None
        if disk_name.startswith("model."):
            return "backbone." + disk_name.removeprefix("model.")
        return disk_name


def _check_config(config: ModelConfig) -> None:
    unknown = sorted(set(config.layer_types) - set(HYBRID_LAYER_KINDS))
    if unknown:
        raise ConfigError(
            f"{config.architecture}: Nemotron-H layers must be {list(HYBRID_LAYER_KINDS)}, "
            f"got {unknown}"
        )
    uses_relu2 = MLP in config.layer_types or MOE in config.layer_types
    if uses_relu2 and config.hidden_act != "relu2":
        raise ConfigError(
            f"{config.architecture}: mlp_hidden_act is {config.hidden_act!r}; "
            "Nemotron-H MLP and MoE layers support only 'relu2'"
        )
