"""Architecture registry: lookup, lazy import, and per-class `auto` preferences."""

from __future__ import annotations

import subprocess
import sys

import pytest

from models.errors import UnsupportedArchitectureError
from models.registry import (
    WRAPPER_ARCHITECTURES,
    model_class_for,
    model_preferences,
    supported_architectures,
)

DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
WRAPPERS = (
    "NemotronH_Nano_VL_V2",
    "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Omni_Reasoning_V3",
)


def test_supported_architectures_lists_every_family() -> None:
    names = supported_architectures()
    assert set(names) == {*DENSE, "NemotronHForCausalLM", *WRAPPERS}
    assert list(names) == sorted(names)
    assert frozenset(WRAPPERS) == WRAPPER_ARCHITECTURES


@pytest.mark.parametrize("architecture", DENSE)
def test_dense_families_share_the_llama_class(architecture: str) -> None:
    from models.llama import LlamaForCausalLM

    assert model_class_for(architecture) is LlamaForCausalLM


def test_dense_model_has_no_preferences() -> None:
    assert model_preferences("LlamaForCausalLM") == (None, None)


def test_unknown_architecture() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM.*LlamaForCausalLM"):
        model_class_for("FalconForCausalLM")


def test_registry_and_config_parsing_do_not_import_torch() -> None:
    code = (
        "import sys, models.registry, models.hf_config\n"
        "models.registry.supported_architectures()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_hybrid_backbone_prefers_v2_and_python_transceiver() -> None:
    assert model_preferences("NemotronHForCausalLM") == ("v2", "python")


@pytest.mark.parametrize("architecture", WRAPPERS)
def test_wrappers_take_preferences_from_the_backbone(architecture: str) -> None:
    assert model_preferences(architecture) == ("v2", "python")
