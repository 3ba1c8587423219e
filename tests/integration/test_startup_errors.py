"""`disagg serve` on a broken checkpoint or an impossible cache budget.

Each case fails at startup with one `error:` line naming the problem, no
traceback, and a non-zero exit, before any worker (or Ray itself) starts.
A failure that only a worker can see (its weights do not load) is checked in
process: the launcher raises `LaunchError` and leaves no actor or placement
group behind.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import yaml

from cluster.launch.launcher import init_local_ray

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


def _broken_copy(good: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(good, folder)
    damage(folder)
    return folder


def _remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def _set_config(**fields: object) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))

    return damage


def _shrink_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, folder / "model.safetensors")


def _config_file(model: Path, tmp_path: Path, **config: object) -> Path:
    path = tmp_path / "cluster.yaml"
    raw = {"model": str(model), "port": 0, "cache_transceiver": {"backend": "python"}}
    path.write_text(yaml.safe_dump(raw | config))
    return path


def _serve(model: Path, tmp_path: Path, **config: object) -> subprocess.CompletedProcess[str]:
    """`disagg serve -c <config>` as a user runs it, in a subprocess."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            "-c",
            str(_config_file(model, tmp_path, **config)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _serve_in_process(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], **config: object
) -> subprocess.CompletedProcess[str]:
    """The same command through the CLI entry point in this process (no interpreter start)."""
    from cluster.cli import main

    started = ray.is_initialized()
    code = main(["serve", "-c", str(_config_file(model, tmp_path, **config))])
    assert ray.is_initialized() == started, "the failed startup touched Ray"
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["disagg", "serve"], code, out, err)


def _assert_one_clear_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    for needle in needles:
        assert needle in result.stderr, output
    # Nothing was started: no plan table, no Ray.
    assert "serving " not in result.stdout and "Ray" not in output, output


CHECKPOINT_CASES = {
    "no config.json": (_remove("config.json"), ("config.json not found",)),
    "no weights": (_remove("model.safetensors"), ("no weights in", "model.safetensors")),
    "no tokenizer": (_remove("tokenizer.json"), ("tokenizer.json not found",)),
    "unsupported architecture": (
        _set_config(architectures=["GPT2LMHeadModel"]),
        ("GPT2LMHeadModel",),
    ),
    "wrong tensor shape": (
        _shrink_tensor,
        ("model.layers.0.self_attn.q_proj.weight", "expected shape (64, 64), found (63, 64)"),
    ),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_a_broken_checkpoint_fails_before_anything_starts(
    case: str, good_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damage, needles = CHECKPOINT_CASES[case]
    broken = _broken_copy(good_checkpoint, tmp_path, damage)
    _assert_one_clear_error(_serve_in_process(broken, tmp_path, capsys), *needles)


@pytest.mark.parametrize(
    ("budget", "needle"),
    [
        ({"cpu_memory_bytes": 1024}, "kv_cache"),
        ({"max_tokens": 8}, "raise max_tokens to at least 16"),
    ],
)
def test_a_cache_too_small_for_one_block_fails_before_anything_starts(
    budget: dict[str, int],
    needle: str,
    good_checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _serve_in_process(good_checkpoint, tmp_path, capsys, kv_cache=budget)
    _assert_one_clear_error(result, needle)


def test_the_command_exits_non_zero_with_one_line_for_wrong_tensor_shapes(
    good_checkpoint: Path, tmp_path: Path
) -> None:
    broken = _broken_copy(good_checkpoint, tmp_path, _shrink_tensor)
    result = _serve(broken, tmp_path)
    assert result.returncode == 2
    _assert_one_clear_error(result, "expected shape (64, 64), found (63, 64)")


@pytest.fixture
def local_ray() -> Iterator[None]:
    init_local_ray(2, logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_a_worker_that_cannot_load_its_weights_leaves_nothing_running(
    good_checkpoint: Path, tmp_path: Path, local_ray: None
) -> None:
    from cluster.config.plan import resolve_plan
    from cluster.config.schema import config_from_dict
    from cluster.launch.launcher import LaunchError, launch

    broken = _broken_copy(good_checkpoint, tmp_path, _shrink_tensor)
    raw = {"model": str(broken), "kv_cache": {"max_tokens": 256}}
    plan = resolve_plan(config_from_dict(raw | {"cache_transceiver": {"backend": "python"}}))
    # Only a worker reads the weights, so the launcher sees the failure.
    plan = replace(plan, instances=plan.instances[:1])
    with pytest.raises(LaunchError) as info:
        asyncio.run(launch(plan, timeout_s=TIMEOUT_S))
    assert "context-0 failed to start" in str(info.value)
    assert "expected shape (64, 64), found (63, 64)" in str(info.value)
    # Every actor the launcher creates is named, so this lists any survivor.
    alive = ray.util.list_named_actors(all_namespaces=True)
    assert alive == [], alive
    groups = ray.util.placement_group_table().values()
    assert all(group["state"] == "REMOVED" for group in groups), groups
