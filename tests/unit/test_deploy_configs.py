"""Every file under deploy/ loads with the tool that consumes it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.config.plan import resolve_plan
from cluster.config.reader import load_config
from cluster.config.schema import config_from_dict

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
        "nemotron-h-reuse.yaml",
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


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_every_node_runs_the_one_setup_script(path: Path) -> None:
    script = "bash ~/disagg/deploy/ray/setup-node.sh"
    raw = yaml.safe_load(path.read_text())
    assert raw["setup_commands"] == [script]
    assert not raw.get("head_setup_commands") and not raw.get("worker_setup_commands")
    config = _ray_prepared(path)  # what Ray runs on each kind of node
    assert script in config["head_setup_commands"] and script in config["worker_setup_commands"]


def test_the_setup_script_installs_torch_before_the_project_and_cpu_torch_without_a_gpu() -> None:
    lines = (DEPLOY / "ray" / "setup-node.sh").read_text().splitlines()
    gpu_check = next(i for i, line in enumerate(lines) if "nvidia-smi -L" in line)
    cuda_torch, cpu_torch = (
        i for i, line in enumerate(lines) if "pip install" in line and "torch==" in line
    )
    project = next(i for i, line in enumerate(lines) if "install --quiet -e ." in line)
    assert gpu_check < cuda_torch < cpu_torch < project  # torch first, or pip pulls CUDA
    assert "whl/cpu" not in lines[cuda_torch]
    assert "torch==2.13.0+cpu" in lines[cpu_torch] and "whl/cpu" in lines[cpu_torch]


@pytest.mark.parametrize("path", DISAGG_CONFIGS, ids=lambda p: p.name)
def test_disagg_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.role_settings("generation_servers").num_instances >= 1
    # Only the aggregated-only examples have no context instance.
    context = config.role_settings("context_servers").num_instances
    assert context >= 1 or path.name.startswith("aggregated")


@pytest.fixture(scope="module")
def config_only_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """config.json-only folders per embedded architecture: enough to resolve a plan."""
    from models.embedded.configs import checkpoint_config

    folders = {}
    for arch in ("llama", "nemotron_h"):
        folder = tmp_path_factory.mktemp(arch)
        (folder / "config.json").write_text(json.dumps(checkpoint_config(arch, "tiny")))
        folders[arch] = folder
    return folders


@pytest.mark.parametrize("path", DISAGG_CONFIGS, ids=lambda p: p.name)
def test_disagg_config_resolves_a_plan(
    path: Path, config_only_checkpoints: dict[str, Path]
) -> None:
    raw = yaml.safe_load(path.read_text())
    arch = "nemotron_h" if "nemotron" in raw["model"] else "llama"
    raw["model"] = str(config_only_checkpoints[arch])
    plan = resolve_plan(config_from_dict(raw, source=str(path)), source=str(path))
    roles = [i.role for i in plan.instances]
    assert roles.count("context") == raw["context_servers"]["num_instances"]
    assert roles.count("generation") == raw["generation_servers"]["num_instances"]
    if raw.get("cache_transceiver", {}).get("backend") == "nixl":
        assert len({i.manager for i in plan.instances}) == 1
    if arch == "nemotron_h":
        assert plan.is_hybrid and {i.manager for i in plan.instances} == {"v2"}
    if arch == "nemotron_h" and raw["kv_cache"].get("enable_block_reuse"):
        assert all(i.enable_block_reuse and i.snapshots for i in plan.instances)
    ranks = raw["generation_servers"].get("tensor_parallel_size", 1)
    assert {i.tensor_parallel_size for i in plan.of_role("generation")} == {ranks}


def test_serve_address_flag_joins_a_cluster_with_a_local_config() -> None:
    import argparse

    from cluster.serve import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    local = DEPLOY / "configs" / "2p2d.yaml"
    assert build_config(parser.parse_args(["-c", str(local)])).address is None
    args = parser.parse_args(["-c", str(local), "--address", "auto"])
    assert build_config(args).address == "auto"


def test_every_ray_exec_command_serves_a_config_that_joins_the_cluster() -> None:
    """A config without `address` starts a Ray of its own; on a `ray up` head
    that would leave the GPU nodes idle."""
    import re

    readme = DEPLOY.parent / "README.md"
    readmes = [readme, DEPLOY / "README.md"]
    texts = [path.read_text() for path in [*readmes, *CLUSTER_YAMLS]]
    commands = [
        " ".join(line.split())
        for text in texts
        # the quoted command of a `ray exec` (runs on the head)
        for line in re.findall(r"disagg serve -c (deploy/configs/\S+?\.yaml[^'\n]*)'", text)
    ]
    assert len(commands) >= 3, commands
    for command in commands:
        config_path, *flags = command.split()
        address = load_config(DEPLOY.parent / config_path).address
        joins = address == "auto" or "--address auto" in " ".join(flags)
        assert joins, f"`disagg serve -c {command}` would start its own Ray on the head"
