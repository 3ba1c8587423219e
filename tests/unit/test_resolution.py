"""The `auto` rules for manager, transceiver, cluster layout and block reuse."""

from __future__ import annotations

import logging

import pytest

from kvcache import resolution
from kvcache.errors import LayoutConflictError, ResolutionError
from kvcache.resolution import (
    resolve_block_reuse,
    resolve_cluster_managers,
    resolve_manager,
    resolve_transceiver,
)

# What `models.registry.model_preferences` gives: hybrid Mamba models (and the
# VL wrappers around them) prefer V2 and the Python transceiver; dense none.
HYBRID_MANAGER, HYBRID_TRANSCEIVER = "v2", "python"
DENSE_MANAGER, DENSE_TRANSCEIVER = None, None


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolution, "_logged", set())


def test_manager_auto_takes_the_preference_else_v1() -> None:
    assert resolve_manager("auto", HYBRID_MANAGER) == "v2"
    assert resolve_manager("auto", DENSE_MANAGER) == "v1"
    assert resolve_manager("v1", HYBRID_MANAGER) == "v1"
    assert resolve_manager("v2", DENSE_MANAGER) == "v2"
    with pytest.raises(ResolutionError, match="kv_cache.manager must be one of"):
        resolve_manager("v3", None)


def test_decision_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvcache.resolution"):
        resolve_manager("auto", HYBRID_MANAGER)
        resolve_manager("auto", HYBRID_MANAGER)
    assert caplog.text.count("kv_cache.manager auto -> 'v2' (model preference)") == 1


def test_transceiver_auto() -> None:
    assert resolve_transceiver("auto", HYBRID_TRANSCEIVER, nixl_importable=True) == "python"
    assert resolve_transceiver("auto", DENSE_TRANSCEIVER, nixl_importable=True) == "nixl"
    assert resolve_transceiver("auto", DENSE_TRANSCEIVER, nixl_importable=False) == "python"
    assert resolve_transceiver("python", None, nixl_importable=True) == "python"
    with pytest.raises(ResolutionError, match="nixl package cannot be imported"):
        resolve_transceiver("nixl", None, nixl_importable=False)


def test_hybrid_auto_resolves_to_v2_on_both_sides() -> None:
    for transceiver in ("python", "nixl"):
        assert resolve_cluster_managers("auto", "auto", HYBRID_MANAGER, transceiver) == ("v2", "v2")


@pytest.mark.parametrize(("context", "generation"), [("v2", "auto"), ("auto", "v2"), ("v2", "v2")])
def test_v2_is_kept_on_nixl_when_the_other_side_is_auto(context: str, generation: str) -> None:
    # A dense model: the auto side alone would resolve to v1.
    assert resolve_cluster_managers(context, generation, DENSE_MANAGER, "nixl") == ("v2", "v2")


def test_explicit_side_binds_the_auto_side_on_nixl() -> None:
    assert resolve_cluster_managers("v1", "auto", DENSE_MANAGER, "nixl") == ("v1", "v1")


@pytest.mark.parametrize(("context", "generation"), [("v1", "auto"), ("auto", "v1")])
def test_forced_v1_facing_a_preferred_v2_is_a_conflict_on_nixl(
    context: str, generation: str
) -> None:
    # The hybrid's auto side resolves to v2; demoting it to v1 is never done.
    with pytest.raises(LayoutConflictError, match="resolved to 'v2' by the model's preference"):
        resolve_cluster_managers(context, generation, HYBRID_MANAGER, "nixl")


def test_explicit_v1_v2_conflict_on_nixl_names_both_sections() -> None:
    with pytest.raises(LayoutConflictError) as info:
        resolve_cluster_managers("v1", "v2", HYBRID_MANAGER, "nixl")
    message = str(info.value)
    assert "kv_cache.manager is 'v1' on context_servers but 'v2' on generation_servers" in message
    assert "the NIXL backend needs one layout" in message


def test_python_transceiver_resolves_each_side_on_its_own() -> None:
    assert resolve_cluster_managers("v1", "v2", DENSE_MANAGER, "python") == ("v1", "v2")
    assert resolve_cluster_managers("v2", "auto", DENSE_MANAGER, "python") == ("v2", "v1")
    # The hybrid defaults: v2 manager with the python transceiver, together.
    transceiver = resolve_transceiver("auto", HYBRID_TRANSCEIVER, nixl_importable=True)
    assert resolve_cluster_managers("auto", "auto", HYBRID_MANAGER, transceiver) == ("v2", "v2")
    assert transceiver == "python"


def test_block_reuse_is_opt_in_and_only_under_v2_for_dense_models(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert resolve_block_reuse(False, "v2", is_hybrid=False) is False
    assert resolve_block_reuse(True, "v2", is_hybrid=False) is True
    with caplog.at_level(logging.INFO, logger="kvcache.resolution"):
        assert resolve_block_reuse(True, "v1", is_hybrid=False) is False
        assert resolve_block_reuse(True, "v2", is_hybrid=True) is False
    assert "needs kv_cache.manager 'v2'" in caplog.text
    assert "Mamba state snapshot" in caplog.text
