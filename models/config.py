"""The parsed, frozen model configuration every model class is built from.

`ModelConfig` is architecture-neutral: dense decoders leave `mamba` and `moe`
unset; hybrid models list each layer's kind in `layer_types`, and their
multi-token-prediction (MTP) layers' kinds in `mtp_layer_types`. Parsing from a
checkpoint's config.json lives in `models/hf_config.py`.

With `use_mtp` the MTP attention layers own paged KV too, after the backbone's
(backbone pattern "M*M*", MTP pattern "*E"):

    model layer index     0  1  2  3 | 4  5           (MTP layer i -> 4 + i)
    kind                  M  *  M  * | *  E
    attention ordinal        0     1 | 2              caches.attention[2]: MTP layer 0
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.spec import CacheSpec, HeadShard

# Layer kinds of `ModelConfig.layer_types`.
DECODER = "decoder"  # dense block: attention + MLP (Llama-style)
ATTENTION = "attention"  # hybrid block: attention mixer only
MAMBA = "mamba"
MLP = "mlp"
MOE = "moe"
LAYER_KINDS = (DECODER, ATTENTION, MAMBA, MLP, MOE)
KV_LAYER_KINDS = (DECODER, ATTENTION)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # None, "linear", "dynamic", "llama3" or "yarn" (Hugging Face `rope_type` names)
    scaling_type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class TensorParallelShard:
    """Which shard a model is: rank `rank` of the `size` ranks of one instance.

    The ranks of an instance are the processes of one torch.distributed group
    (the process's default group); `models.tensor_parallel` says which slice
    of every weight each rank holds.
    """

    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class MambaShard:
    """Where a tensor-parallel rank's Mamba2 heads and B/C groups sit among
    the whole model's (`models.sharding.shard_config`). Head h of the model
    reads group `h // heads_per_group`."""

    first_head: int  # the rank's first head and first kept group, in the model's numbering
    first_group: int
    model_heads: int  # the whole model's num_heads and n_groups
    model_groups: int
    tp: TensorParallelShard

    @property
    def heads_per_group(self) -> int:
        return self.model_heads // self.model_groups

    @property
    def whole_groups(self) -> bool:
        """Each rank holds whole groups (n_groups splits over the ranks), so the
        gated norm, which runs over a group's heads, stays on the rank."""
        return self.model_groups % self.tp.size == 0

    def head_groups(self, num_heads: int) -> tuple[int, ...]:
        """The group of each of the rank's `num_heads` heads, counted among its kept groups."""
        per_group, first = self.heads_per_group, self.first_head
        return tuple((first + h) // per_group - self.first_group for h in range(num_heads))


@dataclass(frozen=True)
class MambaConfig:
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    time_step_min: float = 0.001
    norm_eps: float = 1e-5
    # A tensor-parallel rank's share; None for the whole model.
    shard: MambaShard | None = None

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class VisionConfig:
    """The image path of a VL / Omni wrapper: RADIO tower, pixel shuffle, projector.

    An image of `grid_hw` patches (each `patch_size` pixels square) runs through
    the tower as `num_prefix_tokens` learned tokens plus one token per patch;
    the patch features are pixel-shuffled by `merge_size` per side and
    projected to the language model's hidden size, one embedding per
    `image_token_id` placeholder of the prompt.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    layer_norm_eps: float
    qkv_bias: bool
    num_channels: int
    patch_size: int
    max_img_size: int
    num_prefix_tokens: int  # cls + register tokens before the patches
    downsample_ratio: float
    projector_hidden_size: int
    image_token_id: int
    final_layernorm: bool  # a LayerNorm on the tower output (checkpoints with MTP layers)
    hidden_act: str = "gelu"

    @property
    def merge_size(self) -> int:
        """Patches merged per side by the pixel shuffle (2 for ratio 0.5)."""
        return round(1 / self.downsample_ratio)

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size**2

    def num_image_tokens(self, grid_hw: tuple[int, int]) -> int:
        """Placeholder tokens (and embeddings) of an image of `grid_hw` patches."""
        return grid_hw[0] * grid_hw[1] // self.merge_size**2


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Bias on the attention output projection; None means "same as attention_bias"
    # (Llama). Qwen2 has q/k/v biases but none on o_proj.
    attention_output_bias: bool | None = None
    # Keys further than this many positions behind a query are masked (Mistral);
    # None attends to the whole context.
    sliding_window: int | None = None
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope: RopeConfig | None = field(default_factory=RopeConfig)
    mamba: MambaConfig | None = None
    moe: MoEConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"
    # The image path of a VL / Omni wrapper; None for text-only models.
    vision: VisionConfig | None = None
    # A rank's config (`models.tensor_parallel.shard_config`) holds its share
    # of the heads and the MLP width; `vocab_size` stays the whole vocabulary.
    tp: TensorParallelShard = field(default_factory=TensorParallelShard)
    # Which of the whole model's heads a rank's cache holds; None: all.
    cache_shard: HeadShard | None = None
    # The checkpoint's multi-token-prediction layers (Nemotron-H `mtp.*`):
    # how many predict steps it ships and the kinds of one step's layers.
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    # Build and load the MTP layers, whose attention KV joins the cache (the
    # engine sets it when it drafts with them).
    use_mtp: bool = False

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, *kinds: str) -> tuple[int, ...]:
        """Backbone layers of these kinds (the MTP layers are not among them)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in kinds)

    def mtp_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the MTP attention layers that own paged KV:
        `num_hidden_layers + i` for MTP layer i; empty unless `use_mtp`."""
        if not self.use_mtp:
            return ()
        first = self.num_hidden_layers
        return tuple(
            first + i for i, kind in enumerate(self.mtp_layer_types) if kind in KV_LAYER_KINDS
        )

    def cache_spec(self, dtype: str | None = None) -> CacheSpec:
        """Cache shapes for this model; `dtype` overrides the KV/conv dtype."""
        mamba_layers = self.layers_of(MAMBA)
        conv: tuple[int, ...] = ()
        ssm: tuple[int, ...] = ()
        if self.mamba is not None and mamba_layers:
            conv = (self.mamba.conv_dim, self.mamba.conv_kernel - 1)
            ssm = (self.mamba.num_heads, self.mamba.head_dim, self.mamba.state_size)
        return CacheSpec(
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            attention_layers=self.layers_of(*KV_LAYER_KINDS) + self.mtp_attention_layers(),
            dtype=dtype or self.dtype,
            mamba_layers=mamba_layers,
            conv_state_shape=conv,
            ssm_state_shape=ssm,
            shard=self.cache_shard,
        )
