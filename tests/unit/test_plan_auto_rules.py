"""The `auto` contract end to end: config.json -> registry preference -> plan.

Each case writes only a checkpoint's config.json (the plan reads nothing
else) and resolves an all-`auto` disagg config the way `disagg serve` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.config.plan import ClusterPlan, resolve_plan
from cluster.config.schema import ConfigError, config_from_dict
from models.embedded import VL_ARCHITECTURES, checkpoint_config

HYBRIDS = [("nemotron_h", None)] + [("nemotron_vl", name) for name in VL_ARCHITECTURES]


def _checkpoint(tmp_path: Path, arch: str, vl_architecture: str | None) -> tuple[Path, dict]:
    raw = checkpoint_config(arch, vl_architecture=vl_architecture)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path, raw


def _plan(model: Path, **overrides: Any) -> ClusterPlan:
    return resolve_plan(config_from_dict({"model": str(model), **overrides}))


@pytest.mark.parametrize(("arch", "vl_architecture"), HYBRIDS)
def test_every_hybrid_architecture_resolves_auto_to_v2_and_python(
    tmp_path: Path, arch: str, vl_architecture: str | None
) -> None:
    model, raw = _checkpoint(tmp_path, arch, vl_architecture)
    if vl_architecture is not None:
        # The wrapper's hybrid pattern sits one level down; the outer config has none.
        assert "hybrid_override_pattern" not in raw and "vocab_size" not in raw
        assert raw["architectures"] == [vl_architecture]
    plan = _plan(model)
    assert plan.transceiver == "python"
    assert {i.manager for i in plan.instances} == {"v2"}
    assert not any(i.enable_block_reuse for i in plan.instances)
    nested = raw.get("llm_config", raw)
    assert plan.vocab_size == nested["vocab_size"]


@pytest.mark.parametrize(("arch", "vl_architecture"), HYBRIDS)
def test_v2_stays_v2_on_the_nixl_route(
    tmp_path: Path, arch: str, vl_architecture: str | None
) -> None:
    model, _ = _checkpoint(tmp_path, arch, vl_architecture)
    plan = _plan(model, cache_transceiver={"backend": "nixl"})
    assert plan.transceiver == "nixl"
    assert {i.manager for i in plan.instances} == {"v2"}
    forced = {
        "cache_transceiver": {"backend": "nixl"},
        "context_servers": {"kv_cache": {"manager": "v1"}},
    }
    with pytest.raises(ConfigError, match="context_servers.*generation_servers"):
        _plan(model, **forced)


def test_dense_llama_has_no_preference_and_reuse_stays_opt_in(tmp_path: Path) -> None:
    model, _ = _checkpoint(tmp_path, "llama", None)
    plan = _plan(model, cache_transceiver={"backend": "python"})
    assert {i.manager for i in plan.instances} == {"v1"}
    v2 = _plan(model, cache_transceiver={"backend": "python"}, kv_cache={"manager": "v2"})
    assert not any(i.enable_block_reuse for i in v2.instances)
    asked = {"manager": "v2", "enable_block_reuse": True}
    reuse = _plan(model, cache_transceiver={"backend": "python"}, kv_cache=asked)
    assert all(i.enable_block_reuse for i in reuse.instances)
