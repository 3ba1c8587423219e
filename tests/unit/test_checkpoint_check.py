"""The serve command's checkpoint check builds each model on the meta device
and loads the safetensors headers' shapes into it. It must stay cheap: no op
on the way may run torch._refs code, whose first call imports torch._dynamo
(1.5-3 s of every `disagg serve` start on a 2-core machine). Every damaged
checkpoint it reads is one `error:` line and exit status 2 from `disagg serve`
(and more cases, through a config file, in tests/integration/test_startup_errors.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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
        check_checkpoint(folder, "c.yaml:model")


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
Tensors = dict[str, torch.Tensor]


def _rewrite_tensors(change: Callable[[Tensors], object]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors")

    return damage


def _cut_short(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        with path.open("r+b") as file:
            file.truncate(path.stat().st_size // 2)

    return damage


def _shrunk(tensors: Tensors) -> None:
    tensors[Q_PROJ] = tensors[Q_PROJ][:-1].contiguous()


def _as_int32(tensors: Tensors) -> None:
    tensors[Q_PROJ] = tensors[Q_PROJ].to(torch.int32)


DAMAGED = {
    "truncated weights": (_cut_short("model.safetensors"), "truncated or damaged"),
    "truncated tokenizer": (_cut_short("tokenizer.json"), "tokenizer.json does not load"),
    "missing tensor": (_rewrite_tensors(lambda t: t.pop(Q_PROJ)), f"missing tensors: {Q_PROJ}"),
    "wrong shape": (_rewrite_tensors(_shrunk), "expected shape (64, 64), found (63, 64)"),
    "wrong dtype": (_rewrite_tensors(_as_int32), f"not floating point: {Q_PROJ} (I32)"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_serve_on_a_damaged_checkpoint_prints_one_error_line_and_exits_2(
    case: str, checkpoints: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.cli import main

    damage, needle = DAMAGED[case]
    folder = shutil.copytree(checkpoints[0], tmp_path / "damaged")
    damage(folder)
    assert main(["serve", "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    # The flag named the model, so the message starts with it.
    assert err.startswith("error: --model: ") and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_checkpoint_passes(
    dtype: torch.dtype, checkpoints: list[Path], tmp_path: Path
) -> None:
    from cluster.config.checkpoint_check import check_checkpoint

    folder = shutil.copytree(checkpoints[0], tmp_path / "half")
    _rewrite_tensors(lambda t: t.update({n: x.to(dtype) for n, x in t.items()}))(folder)
    check_checkpoint(folder)


def test_mtp_tensors_are_checked_when_mtp_drafting_loads_them(tmp_path: Path) -> None:
    """A damaged `mtp.*` tensor passes while the workers skip the MTP layers,
    and fails the check when `speculative_config.method: mtp` loads them."""
    from cluster.config.checkpoint_check import check_checkpoint
    from cluster.config.schema import ConfigError

    folder = ensure_checkpoint(tmp_path / "nh", "nemotron_h", "tiny", mtp=True)
    name = "mtp.layers.0.eh_proj.weight"
    _rewrite_tensors(lambda t: t.update({name: t[name][:-1].contiguous()}))(folder)
    check_checkpoint(folder, "c.yaml:model")
    with pytest.raises(ConfigError, match=rf"c.yaml:model: .*{name}"):
        check_checkpoint(folder, "c.yaml:model", use_mtp=True)
