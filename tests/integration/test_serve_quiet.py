"""`disagg serve` on a local Ray, started and stopped as a user does, prints
no warning: Ray's token-authentication notice came at every start, and "the
local Ray is gone" at every stop by Ctrl-C or SIGTERM, which reach the whole
process group, Ray's own processes included, so finding Ray gone is the
normal way down. (Run with RAY_AUTH_MODE unset, as a user's shell has it.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve_process import ROOT, start_serve

CONFIG = ROOT / "deploy" / "configs" / "1p1d.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


def test_a_start_and_a_stop_by_signal_print_no_warning(checkpoint: Path) -> None:
    server = start_serve(CONFIG, checkpoint)
    assert server.stop() == 0  # SIGTERM to the process group
    warnings = [line for line in server.output if "WARNING" in line]
    assert not warnings, "".join(warnings)
    assert "stopped\n" in server.output
