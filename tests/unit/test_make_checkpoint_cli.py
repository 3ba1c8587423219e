"""`disagg make-checkpoint`: writes a folder; user errors are one stderr line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _unwritable_parent(tmp_path: Path) -> Path:
    """A folder nobody may create entries in, root included."""
    if os.geteuid() == 0:
        return Path("/sys")  # sysfs refuses mkdir even for root
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked


def test_writes_a_complete_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    code = main(["make-checkpoint", "--arch", "llama", "--size", "tiny", "--seed", "3", str(out)])
    assert code == 0
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (out / name).is_file()
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "embedded_checkpoint.json").read_text())["seed"] == 3
    assert str(out) in capsys.readouterr().out


def test_vl_architecture_and_initializer_range_flags(tmp_path: Path) -> None:
    out = tmp_path / "vl"
    args = ["make-checkpoint", "--arch", "nemotron_vl", "--initializer-range", "0.05"]
    args += ["--vl-architecture", "NemotronH_Nano_Omni_Reasoning_V3", str(out)]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NemotronH_Nano_Omni_Reasoning_V3"]
    assert config["llm_config"]["initializer_range"] == 0.05


def test_image_format_flag_writes_the_tiling_preprocessor_config(tmp_path: Path) -> None:
    out = tmp_path / "tiles"
    assert (
        main(["make-checkpoint", "--arch", "nemotron_vl", "--image-format", "tiles", str(out)]) == 0
    )
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert (processor["image_size"], processor["max_num_tiles"]) == (64, 4)
    assert json.loads((out / "embedded_checkpoint.json").read_text())["image_format"] == "tiles"
    default = tmp_path / "dynamic"
    assert main(["make-checkpoint", "--arch", "nemotron_vl", str(default)]) == 0
    assert "max_num_patches" in json.loads((default / "preprocessor_config.json").read_text())


@pytest.mark.parametrize(
    ("arch", "prefix"), [("nemotron_h", ""), ("nemotron_vl", "language_model.")]
)
def test_mtp_flag_writes_the_released_mtp_layout(tmp_path: Path, arch: str, prefix: str) -> None:
    from safetensors import safe_open

    out = tmp_path / arch
    assert main(["make-checkpoint", "--arch", arch, "--mtp", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    llm = config.get("llm_config", config)
    assert (llm["num_nextn_predict_layers"], llm["mtp_hybrid_override_pattern"]) == (1, "*E")
    assert json.loads((out / "embedded_checkpoint.json").read_text())["mtp"] is True
    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {
            name.removeprefix(prefix): tuple(f.get_slice(name).get_shape())
            for name in f.keys()  # noqa: SIM118 - safe_open is not a mapping
            if name.startswith(prefix + "mtp.")
        }
    mtp = set(shapes)
    hidden = llm["hidden_size"]
    assert shapes["mtp.layers.0.eh_proj.weight"] == (hidden, 2 * hidden)
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight"} <= mtp
    assert {"mtp.layers.0.mixer.q_proj.weight", "mtp.layers.0.norm.weight"} <= mtp
    assert "mtp.layers.1.mixer.gate.e_score_correction_bias" in mtp
    assert "mtp.layers.1.final_layernorm.weight" in mtp
    experts = {name for name in mtp if ".mixer.experts." in name}
    assert len(experts) == 2 * llm["n_routed_experts"]


def test_hybrid_pattern_flag_writes_those_layers_and_no_others(tmp_path: Path) -> None:
    from safetensors import safe_open

    from models.loader import load_model

    out = tmp_path / "no-moe"
    assert (
        main(["make-checkpoint", "--arch", "nemotron_h", "--hybrid-pattern", "M-M*-M", str(out)])
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "M-M*-M" and config["num_hidden_layers"] == 6
    assert config["layers_block_type"][3] == "full_attention"
    assert json.loads((out / "embedded_checkpoint.json").read_text())["hybrid_pattern"] == "M-M*-M"
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if ".experts." in n or ".gate." in n]
    assert "backbone.layers.5.mixer.A_log" in names
    model, model_config = load_model(out, dtype="float32", device="cpu")
    assert model_config.layer_types == ("mamba", "mlp", "mamba", "attention", "mlp", "mamba")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--arch", "nemotron_h", "--hybrid-pattern", "M-X"], "'M-X' must be one of M, *, -, E"),
        (["--arch", "nemotron_h", "--hybrid-pattern=--E"], "needs a Mamba (M) or attention"),
        (
            ["--arch", "llama", "--hybrid-pattern", "M*"],
            "applies to arch nemotron_h and nemotron_vl",
        ),
    ],
)
def test_a_bad_hybrid_pattern_is_one_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["make-checkpoint", *args, "x"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_mtp_flag_with_llama_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-checkpoint", "--arch", "llama", "--mtp", "x"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mtp" in err and "nemotron_h" in err


def test_out_path_that_is_a_file_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a_file"
    target.write_text("keep me")
    assert main(["make-checkpoint", "--arch", "llama", str(target)]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "existing file" in err
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    "option", [["--vl-architecture", "NemotronH_Nano_VL_V2"], ["--image-format", "tiles"]]
)
def test_vl_options_with_other_arch_are_rejected(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["make-checkpoint", "--arch", "llama", *option, "x"]) != 0
    err = capsys.readouterr().err
    assert "nemotron_vl" in err and option[0] in err


def test_unknown_arch_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["make-checkpoint", "--arch", "gpt2", "out"])
    assert exit_info.value.code != 0
    assert "invalid choice" in capsys.readouterr().err


def test_unwritable_folder_prints_one_line_without_traceback(tmp_path: Path) -> None:
    out = _unwritable_parent(tmp_path) / "embedded-ckpt"
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "make-checkpoint", "--arch", "llama", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0], result.stderr
    assert not out.exists()


def test_help_does_not_import_torch() -> None:
    code = "import sys; from cluster.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr
