"""Llama-style dense decoder (also Mistral and Qwen2) over the paged KV cache.

Built from a rank's config (`models.tensor_parallel.shard_config`), the same
classes run one tensor-parallel shard: layers come out sized for the rank's
heads and MLP width, and the decoder layer all-reduces the attention and MLP
outputs.

Module names mirror Hugging Face's `LlamaForCausalLM`, so checkpoint tensors
load by name: `model.embed_tokens`, `model.layers.N.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}`,
`model.norm`, `lm_head` (shared with the embedding when tied).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvcache.views import AttentionLayerCache, CacheViews
from models.base import CausalLM
from models.batch import ForwardBatch
from models.config import DECODER, ModelConfig, RopeConfig
from models.errors import ConfigError
from models.kernels import dispatch
from models.layers.attention import attend, paged_attention
from models.layers.fused_linear import FusedLinear
from models.layers.linear_mlp import SwiGLUMLP
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, apply_rotary
from models.layers.vocab_parallel import VocabParallelEmbedding
from models.sharding import vocab_rows_per_rank
from models.tensor_parallel import all_reduce, gather_vocab


class LlamaAttention(torch.nn.Module):
    """Rotary GQA self-attention whose K/V live in the paged cache.

    `fuse_projections()` (called once the weights are loaded) runs Q/K/V as
    one matmul, rotates Q and K in one call and prepacks o_proj (see
    `FusedLinear`); on CPU one C pass then rotates Q/K in place and writes
    K/V into the cache. Until fusion, or if it went stale, the plain layers
    run.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = config.sliding_window
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = config.attention_bias
        out_bias = (
            qkv_bias if config.attention_output_bias is None else config.attention_output_bias
        )
        self.q_proj = torch.nn.Linear(hidden, q_size, bias=qkv_bias)
        self.k_proj = torch.nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.v_proj = torch.nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = torch.nn.Linear(q_size, hidden, bias=out_bias)
        self.qkv: FusedLinear | None = None
        self.out: FusedLinear | None = None
        self._qkv_heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def fuse_projections(self) -> None:
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.out = FusedLinear([self.o_proj])

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, ...],
        layer_cache: AttentionLayerCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        cos, sin = cos_sin
        if self.qkv is not None and self.qkv.is_current():
            qkv = self.qkv(hidden).view(num_tokens, -1, self.head_dim)
            keys, values = layer_cache.key_cache, layer_cache.value_cache
            # On CPU: rotation and the cache write in one pass, Q/K rotated in place.
            if dispatch.cpu_rope_and_cache(
                qkv, cos, sin, self.num_heads, keys, values, batch.slot_mapping, batch.block_size
            ):
                q, k, v = qkv.split_with_sizes(self._qkv_heads, dim=1)
                out = attend(q, k, v, layer_cache, batch, self.scale, self.sliding_window)
                return self._project_out(out, num_tokens)
            q, k, v = self._rotate(qkv, cos, sin)
        else:
            q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, layer_cache, batch, self.scale, self.sliding_window)
        return self._project_out(out, num_tokens)

    def _project_out(self, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.out is not None and self.out.is_current():
            return self.out(out)
        return self.o_proj(out)

    def _rotate(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (rotated) and V of the fused projection; Q and K heads rotate together."""
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, self.num_heads + self.num_kv_heads :]


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    The residual stream travels beside the block's output, so each residual
    add is done by the next norm (`RMSNorm.add_and_norm`) in the same pass:
    the layer takes `(hidden, residual)` and returns its sublayer output and
    the stream, with `residual=None` for the first layer. The sums and their
    order are the reference's.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tp = config.tp  # attention and MLP outputs are partial sums across ranks
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, ...],
        layer_cache: AttentionLayerCache,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden.clone()
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = all_reduce(self.self_attn(normed, cos_sin, layer_cache, batch), self.tp)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return all_reduce(self.mlp(normed), self.tp), residual


class LlamaModel(torch.nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.tp)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rope = config.rope or RopeConfig()
        self.rotary_emb = RotaryEmbedding(config.head_dim, rope, config.max_position_embeddings)

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb.cos_sin(batch.positions, hidden.dtype, batch.max_seq_len)
        residual: torch.Tensor | None = None
        for layer, layer_cache in zip(self.layers, caches.attention, strict=True):
            hidden, residual = layer(hidden, residual, cos_sin, layer_cache, batch)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    """Dense decoder; no cache-manager or transceiver preference (`auto` defaults)."""

    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if any(kind != DECODER for kind in config.layer_types):
            raise ConfigError(
                f"{config.architecture}: a dense model needs only decoder layers, "
                f"got {sorted(set(config.layer_types))}"
            )
        self.model = LlamaModel(config)
        # This rank's vocab rows (all of them with one rank).
        rows = vocab_rows_per_rank(config.vocab_size, config.tp.size)
        self.lm_head = torch.nn.Linear(config.hidden_size, rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_head: FusedLinear | None = None

    def forward(self, batch: ForwardBatch, caches: CacheViews) -> torch.Tensor:
        if len(caches.attention) != self.config.num_hidden_layers:
            raise ValueError(
                f"expected {self.config.num_hidden_layers} attention cache views, "
                f"got {len(caches.attention)}"
            )
        return self.model(batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None and self.logits_head.is_current():
            logits = self.logits_head(hidden)
        else:
            logits = self.lm_head(hidden)
        return gather_vocab(logits, self.config.tp, self.config.vocab_size)

    def process_weights_after_loading(self) -> None:
        """Fuse Q/K/V and gate/up and prepack the other projections and the
        head (see `FusedLinear`)."""
        self.logits_head = FusedLinear([self.lm_head])
        for module in self.modules():
            if isinstance(module, LlamaAttention | SwiGLUMLP):
                module.fuse_projections()

    def checkpoint_name(self, disk_name: str) -> str | None:
        # Tied checkpoints may still carry a copy of the embedding as lm_head.
        if disk_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return disk_name
