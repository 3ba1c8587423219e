"""The plan of tensor-parallel instances: per-rank cache sizing and the
configs it refuses, each naming what to change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.config.plan import ClusterPlan, format_plan, resolve_plan
from cluster.config.schema import ConfigError, config_from_dict
from models.embedded import VL_ARCHITECTURES, checkpoint_config

LOCAL = {"max_local_prefill_length": 1 << 20}


def _plan(tmp_path: Path, arch: str = "llama", **overrides: Any) -> ClusterPlan:
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config(arch)))
    return resolve_plan(config_from_dict({"model": str(tmp_path), **overrides}))


def test_each_rank_holds_half_the_kv_heads_so_a_byte_budget_buys_twice_the_blocks(
    tmp_path: Path,
) -> None:
    plan = _plan(
        tmp_path,
        kv_cache={"cpu_memory_bytes": 1 << 22},
        conditional_disagg=LOCAL,
        generation_servers={"tensor_parallel_size": 2},
    )
    context, generation = plan.instances
    assert (context.tensor_parallel_size, generation.tensor_parallel_size) == (1, 2)
    assert context.num_blocks is not None and generation.num_blocks is not None
    # A rank's block is half the bytes: the same budget holds twice the blocks.
    assert generation.num_blocks == 2 * context.num_blocks
    assert generation.worker_config("ckpt", "secret", "127.0.0.1").tensor_parallel_size == 2
    assert "cpu x2" in format_plan(plan)


def test_a_size_that_does_not_split_the_heads_names_the_field_and_the_allowed_sizes(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"num_attention_heads = 4 .*: 1, 2, 4"):
        _plan(tmp_path, conditional_disagg=LOCAL, generation_servers={"tensor_parallel_size": 3})


def test_vl_wrappers_split_their_language_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(checkpoint_config("nemotron_vl", vl_architecture=VL_ARCHITECTURES[0]))
    )
    plan = resolve_plan(
        config_from_dict(
            {
                "model": str(tmp_path),
                "context_servers": {"num_instances": 0},
                "generation_servers": {"tensor_parallel_size": 2},
            }
        )
    )
    assert [i.tensor_parallel_size for i in plan.instances] == [2]


def test_context_and_generation_may_use_different_tensor_parallelism(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        kv_cache={"cpu_memory_bytes": 1 << 22},
        cache_transceiver={"backend": "python"},
        context_servers={"tensor_parallel_size": 2},
    )
    context, generation = plan.instances
    assert (context.tensor_parallel_size, generation.tensor_parallel_size) == (2, 1)
    assert context.num_blocks is not None and generation.num_blocks is not None
    assert context.num_blocks == 2 * generation.num_blocks


def test_tensor_parallel_instances_pick_the_python_transceiver_unless_told(
    tmp_path: Path,
) -> None:
    assert _plan(tmp_path, context_servers={"tensor_parallel_size": 2}).transceiver == "python"
    nixl = {"backend": "nixl"}
    plan = _plan(tmp_path, cache_transceiver=nixl, generation_servers={"tensor_parallel_size": 2})
    assert plan.transceiver == "nixl"
