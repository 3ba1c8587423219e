"""Every file under deploy/ loads with the tool that consumes it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CLUSTER_YAMLS = sorted((DEPLOY / "ray").glob("*.yaml"))
DISAGG_CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))


def _ray_prepared(path: Path) -> dict[str, Any]:
    raw = yaml.safe_load(path.read_text())
    # Ray's `ray up` path: fill provider defaults, merge setup commands, validate.
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


def test_expected_files_exist() -> None:
    assert {p.name for p in CLUSTER_YAMLS} >= {"cluster-gpu.yaml", "cluster-onprem.yaml"}
    assert {p.name for p in DISAGG_CONFIGS} >= {
        "1p1d.yaml",
        "2p1d.yaml",
        "2p2d.yaml",
        "nemotron-h-python.yaml",
        "nixl.yaml",
    }


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_passes_ray_schema_validation(path: Path) -> None:
    config = _ray_prepared(path)
    head = " ".join(config["head_start_ray_commands"])
    worker = " ".join(config["worker_start_ray_commands"])
    assert "ray start --head --port=6379" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert "--dashboard-host=0.0.0.0" in head
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker


def test_gpu_cluster_installs_cpu_torch_on_the_head_and_cuda_torch_on_workers() -> None:
    config = _ray_prepared(DEPLOY / "ray" / "cluster-gpu.yaml")
    assert set(config["available_node_types"]) == {"head", "gpu_worker"}
    head_setup = config["head_setup_commands"]
    worker_setup = config["worker_setup_commands"]
    cpu_torch = next(i for i, c in enumerate(head_setup) if "torch" in c)
    assert "download.pytorch.org/whl/cpu" in head_setup[cpu_torch]
    project = next(i for i, c in enumerate(head_setup) if "install --quiet -e ." in c)
    assert cpu_torch < project  # torch first, or pip pulls the CUDA wheel
    assert not any("whl/cpu" in c for c in worker_setup)
    assert any("torch==" in c for c in worker_setup)


@pytest.mark.parametrize("path", DISAGG_CONFIGS, ids=lambda p: p.name)
def test_disagg_config_loads(path: Path) -> None:
    config = load_config(path)
    for role in ("context_servers", "generation_servers"):
        assert config.role_settings(role).num_instances >= 1
