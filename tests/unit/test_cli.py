"""The `disagg` entry point: how an error a user can fix leaves the process."""

from __future__ import annotations

import argparse

import pytest

import cluster.serve
from cluster.cli import main
from models.errors import CheckpointError, TokenizerError


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("m/model-00002.safetensors is truncated"),
        TokenizerError("m/tokenizer.json not found"),
    ],
)
def test_an_error_that_says_what_to_change_is_one_line_and_exit_2_wherever_raised(
    error: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(_: argparse.Namespace) -> int:
        raise error

    monkeypatch.setattr(cluster.serve, "run", run)
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == f"error: {error}\n"


def test_any_other_exception_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(_: argparse.Namespace) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(cluster.serve, "run", run)
    with pytest.raises(KeyError):
        main(["serve"])
