"""One Nemotron-H layer: a pre-norm block around the mixer its kind names.

Shared by the backbone (`models/nemotron_h.py`) and the multi-token-prediction
layers (`models/nemotron_h_mtp.py`), which name their `norm` and `mixer.*`
like the backbone's layers of the same kind.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.views import AttentionLayerCache, CacheViews
from models.batch import ForwardBatch
from models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from models.errors import ConfigError
from models.kernels import dispatch
from models.layers.attention import paged_attention
from models.layers.fused_linear import FusedLinear
from models.layers.mamba2 import Mamba2Mixer
from models.layers.moe import NemotronHMoE
from models.layers.norm import RMSNorm
from models.layers.relu2_mlp import Relu2MLP
from models.tensor_parallel import all_reduce

HYBRID_LAYER_KINDS = (MAMBA, ATTENTION, MLP, MOE)


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
        self.qkv: FusedLinear | None = None
        self.out: FusedLinear | None = None
        self._qkv_heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def fuse_projections(self) -> None:
        """Q/K/V as one prepacked product and O prepacked (see `FusedLinear`);
        until then, or if a fusion went stale, the layers run one by one."""
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.out = FusedLinear([self.o_proj])

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, layer_cache: AttentionLayerCache
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.qkv is not None and self.qkv.is_current():
            qkv = self.qkv(hidden).view(num_tokens, -1, self.head_dim)
            q, k, v = qkv.split_with_sizes(self._qkv_heads, dim=1)
        else:
            q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, layer_cache, batch, self.scale).reshape(num_tokens, -1)
        if self.out is not None and self.out.is_current():
            return self.out(out)
        return self.o_proj(out)


class NemotronHLayer(nn.Module):
    """A layer's `norm` and the `mixer` of its kind; `ordinal` indexes the
    layer's cache among the layers of that kind (`caches.attention[ordinal]`,
    `caches.mamba[ordinal]`; unused by MLP and MoE layers)."""

    def __init__(self, config: ModelConfig, kind: str, ordinal: int) -> None:
        super().__init__()
        self.kind = kind
        self.ordinal = ordinal
        self.tp = config.tp  # every mixer's output is a partial sum across ranks
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = build_mixer(config, kind)

    def mix(self, x: torch.Tensor, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        """The mixer's output for the normed `x`, summed over the tensor-parallel ranks."""
        if self.kind == MAMBA:
            out = self.mixer(x, batch, caches.mamba[self.ordinal])
        elif self.kind == ATTENTION:
            out = self.mixer(x, batch, caches.attention[self.ordinal])
        elif self.kind == MOE:
            # On a GPU (or where its kernels are forced, as in tests) a decode
            # step must not read the routing back: that stalls the stream and
            # breaks graph capture. On CPU a read costs nothing, and the
            # grouped path reads each chosen expert's weights once, not once
            # per token that chose it.
            sync_free = batch.is_decode_only and dispatch.use_triton(x.device)
            out = self.mixer(x, sync_free=sync_free)
        else:
            out = self.mixer(x)
        return all_reduce(out, self.tp)


class NemotronHBlock(NemotronHLayer):
    """A backbone layer: `x + mixer(norm(x))`."""

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, caches: CacheViews
    ) -> torch.Tensor:
        return hidden + self.mix(self.norm(hidden), batch, caches)


def build_mixer(config: ModelConfig, kind: str) -> nn.Module:
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
