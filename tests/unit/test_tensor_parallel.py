"""Tensor-parallel Llama and Nemotron-H shards vs transformers, fp32, over gloo.

Two processes form one torch.distributed group (gloo, as an instance's ranks
do on CPU); each loads only its shard of a tiny checkpoint written by
transformers and runs chunked prefill and greedy decode through the paged
cache; every rank's logits must match transformers' forward. The checkpoints
cover KV heads split (2 KV heads at TP 2) and replicated (1 KV head at TP 2),
a vocabulary that does not split evenly, tied embeddings and biases on every
projection (the row-parallel biases are added once), and a Nemotron-H with
every layer kind (Mamba2 split per x | B | C section, attention, MLP, MoE),
and the Nemotron Omni wrapper on two images. Two more Nemotron-H checkpoints have B/C groups that do not split over the
ranks: one group read by all 8 heads, and 3 groups over 6 heads; each rank
keeps every group, its heads read their own, and the gated norm over a
group's heads sums across the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

from models.config import TensorParallelShard
from models.errors import ConfigError
from models.hf_config import load_model_config
from models.loader import load_model
from models.nemotron_vl import NemotronVLForCausalLM
from models.sharding import allowed_sizes, shard_config
from models.tensor_parallel import Cut, weight_cut
from tests.paged_harness import assert_matches_reference, run_paged_generation
from tests.unit.test_llama_parity import write_checkpoint
from tests.unit.test_nemotron_h_parity import write_checkpoint as write_nemotron_h
from tests.unit.test_nemotron_vl import (
    IMAGE_TOKEN_ID,
    encode_images,
    generate_with_images,
    image_inputs,
    image_prompt,
    write_omni_checkpoint,
)

TP = 2
DECODE_STEPS = 8
NEMOTRON_H = "nemotron-h"
VL = "omni"
# Nemotron-H checkpoints: config overrides, and the (Mamba heads, B/C groups) a rank holds.
HYBRIDS: dict[str, tuple[dict[str, object], tuple[int, int]]] = {
    NEMOTRON_H: ({}, (4, 1)),
    "groups-replicated": ({"n_groups": 1, "hybrid_override_pattern": "M*M-"}, (4, 1)),
    "groups-shared": (
        {"mamba_num_heads": 6, "n_groups": 3, "hybrid_override_pattern": "M*M-"},
        (3, 3),
    ),
}
CHECKPOINTS = {
    "kv-heads-split": {"num_key_value_heads": 2, "vocab_size": 255},
    "kv-heads-replicated": {
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
    },
}


def _rank_main(rank: int, root: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'group'}", rank=rank, world_size=TP
    )
    try:
        for name in [*CHECKPOINTS, *HYBRIDS]:
            path = root / name
            model, config = load_model(path, tp=TensorParallelShard(rank, TP))
            # The rank holds its shard only: half the heads and vocab rows, one KV head.
            assert config.num_key_value_heads == 1 and config.num_attention_heads == 2
            assert model.lm_head.weight.shape[0] == -(-load_model_config(path).vocab_size // TP)
            if config.mamba is not None:
                assert (config.mamba.num_heads, config.mamba.n_groups) == HYBRIDS[name][1]
            gen = torch.Generator().manual_seed(3)
            prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (11, 5, 17)]
            trace = run_paged_generation(
                model, config.cache_spec(), prompts, chunk_size=6, decode_steps=DECODE_STEPS
            )
            reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            assert_matches_reference(reference, prompts, trace, DECODE_STEPS)
        _vl_images_match_transformers(root / VL, rank)
    finally:
        dist.destroy_process_group()


def _vl_images_match_transformers(path: Path, rank: int) -> None:
    """The VL wrapper's backbone sharded, its image path on rank 0 alone: rank
    1 builds no vision tower and gets the image rows' embeddings from rank 0
    (it passes zeros in their place, which the broadcast overwrites)."""
    model, config = load_model(path, tp=TensorParallelShard(rank, TP))
    assert isinstance(model, NemotronVLForCausalLM)
    assert hasattr(model, "vision_model") == (rank == 0)
    grids = [(2, 4), (6, 2)]
    prompt = image_prompt(grids, seed=2)
    pixel_values, grid_hw = image_inputs(grids, seed=3)
    if rank == 0:
        embeds = encode_images(model, pixel_values, grids)
    else:
        embeds = torch.zeros(prompt.count(IMAGE_TOKEN_ID), config.hidden_size)
    reference = NemotronH_Omni_Reasoning_V3.from_pretrained(path).eval()
    generate_with_images(model, config, reference, prompt, embeds, pixel_values, grid_hw)


def test_two_ranks_match_transformers(tmp_path: Path) -> None:
    # Nemotron-H with Mamba2 (8 heads, 2 groups), attention, MLP and MoE layers.
    for name, (overrides, _) in HYBRIDS.items():
        write_nemotron_h(tmp_path / name, **overrides)
    for name, overrides in CHECKPOINTS.items():
        reference = write_checkpoint(tmp_path / name, **overrides)
        # transformers starts biases at zero; random ones show each is added once.
        with torch.no_grad():
            for param_name, param in reference.named_parameters():
                if param_name.endswith(".bias"):
                    param.normal_(std=0.1)
        reference.save_pretrained(tmp_path / name)
    write_omni_checkpoint(tmp_path / VL)
    mp.spawn(_rank_main, args=(tmp_path,), nprocs=TP, join=True)


def _config(tmp_path: Path, **overrides: object):  # type: ignore[no-untyped-def]
    write_checkpoint(tmp_path, **overrides)
    return load_model_config(tmp_path)


def test_sizes_that_do_not_split_the_heads_are_refused_naming_field_and_sizes(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    assert allowed_sizes(config) == [1, 2, 4]
    with pytest.raises(ConfigError, match=r"num_attention_heads = 4 .* values .*: 1, 2, 4"):
        shard_config(config, 0, 3)


def test_mamba_heads_that_do_not_split_are_refused_while_groups_need_not_split(
    tmp_path: Path,
) -> None:
    write_nemotron_h(tmp_path, mamba_num_heads=6, n_groups=3, hybrid_override_pattern="M*")
    config = load_model_config(tmp_path)
    assert allowed_sizes(config) == [1, 2]
    with pytest.raises(ConfigError, match=r"mamba_num_heads = 6 .* values .*: 1, 2"):
        shard_config(config, 0, 4)
    # Rank 1 of 2 holds heads 3..5 and all 3 groups: in_proj takes z and x
    # of its heads, every group's B and C, dt of its heads.
    cut = weight_cut("backbone.layers.0.mixer.in_proj.weight", config, TensorParallelShard(1, 2))
    inner, bc = 48, 3 * 16
    assert cut is not None and cut.ranges == (
        (24, 48),
        (inner + 24, inner + 48),
        (2 * inner, 2 * inner + bc),
        (2 * inner + bc, 2 * inner + 2 * bc),
        (2 * inner + 2 * bc + 3, 2 * inner + 2 * bc + 6),
    )


def test_replicated_kv_heads_go_to_the_ranks_whose_queries_read_them(tmp_path: Path) -> None:
    config = _config(tmp_path, num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    # TP 4: query heads 0,1 read KV head 0; query heads 2,3 read KV head 1.
    firsts = [
        weight_cut("model.layers.0.self_attn.k_proj.weight", config, TensorParallelShard(r, 4))
        for r in range(4)
    ]
    assert [c.ranges for c in firsts if c] == [((0, 16),), ((0, 16),), ((16, 32),), ((16, 32),)]
    o_bias = [
        weight_cut("model.layers.1.self_attn.o_proj.bias", config, TensorParallelShard(r, 2))
        for r in range(2)
    ]
    assert [(c.ranges, c.length) for c in o_bias if c] == [(((0, 64),), 64), (((0, 0),), 64)]
    assert weight_cut("model.norm.weight", config, TensorParallelShard(1, 2)) is None


def test_a_cut_reads_its_rows_or_columns_and_zero_pads_the_vocab_tail() -> None:
    table = torch.arange(15.0).view(5, 3)
    assert torch.equal(Cut.span(1, 1, 3).read(table), table[:, 1:3])
    assert torch.equal(Cut(0, ((0, 1), (3, 5)), 3).read(table), table[[0, 3, 4]])
    tail = Cut.span(0, 3, 5, 3).read(table)
    assert torch.equal(tail[:2], table[3:]) and torch.equal(tail[2], torch.zeros(3))
