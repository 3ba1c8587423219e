"""The serve command's checkpoint check builds each model on the meta device
and loads the safetensors headers' shapes into it. It must stay cheap: no op
on the way may run torch._refs code, whose first call imports torch._dynamo
(1.5-3 s of every `disagg serve` start on a 2-core machine). That it still
refuses a mis-shaped tensor is checked in tests/integration/test_startup_errors.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.embedded.writer import ensure_checkpoint

ARCHS = ("llama", "nemotron_h", "nemotron_vl")
CHECK = """
import json, sys
from cluster.config.checkpoint_check import check_checkpoint
for path in sys.argv[1:]:
    check_checkpoint(path)
print(json.dumps(sorted(name for name in sys.modules if name.startswith("torch._dynamo"))))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("checked")
    return [ensure_checkpoint(root / arch, arch, "tiny") for arch in ARCHS]


def test_the_check_of_every_model_family_imports_no_dynamo(checkpoints: list[Path]) -> None:
    # A fresh process: this one imported dynamo long ago (transformers does).
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *map(str, checkpoints)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_truncated_safetensors_file_is_one_config_error(
    checkpoints: list[Path], tmp_path: Path
) -> None:
    import shutil

    from cluster.config.checkpoint_check import check_checkpoint
    from cluster.config.schema import ConfigError

    folder = shutil.copytree(checkpoints[0], tmp_path / "truncated")
    weights = folder / "model.safetensors"
    with weights.open("r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    with pytest.raises(ConfigError, match="model.safetensors is not a readable safetensors file"):
        check_checkpoint(folder, "c.yaml")
