"""No device-to-host read in a decode step's forward pass.

The step is built by the model runner and run through the model as the engine
does. On CPU the layers take the code path CUDA tensors take (Triton kernels
forced, under the interpreter, and no C kernels), and `count_host_reads`
counts the ops that would synchronize on a GPU; on CUDA torch's sync debug
mode counts the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.request import Request
from engine.scheduler import ScheduledSequence
from models.embedded.writer import write_checkpoint
from models.host_reads import count_host_reads
from models.kernels.dispatch import FORCE_TRITON_ENV
from models.layers.moe import NemotronHMoE
from tests.unit.test_decode_graphs import make_runner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Params:
    max_tokens = 8
    temperature = 0.0
    seed = None
    logprobs = None


@pytest.mark.parametrize(
    "read",
    [
        lambda t: bool(t.any()),
        lambda t: int(t[0]),
        lambda t: t.max().item(),
        lambda t: t.tolist(),
        lambda t: t[t > 1],
        lambda t: torch.unique(t),
        lambda t: torch.nonzero(t),
    ],
    ids=["bool", "int", "item", "tolist", "mask", "unique", "nonzero"],
)
def test_counter_sees_every_kind_of_read(read: Callable[[torch.Tensor], object]) -> None:
    t = torch.arange(4, device=DEVICE)
    with count_host_reads(DEVICE) as idle:
        t + 1  # noqa: B018 (device work that reads nothing back)
    with count_host_reads(DEVICE) as reads:
        read(t)
    # CUDA may sync more than once for one call (unique: sizes, then values).
    assert idle.count == 0 and reads.count >= 1, (idle.names, reads.names)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("host_reads")
    # Nemotron-H tiny has every layer kind: Mamba2, attention, MLP and MoE.
    return {
        arch: write_checkpoint(root / arch, arch, "tiny", seed=1)
        for arch in ("llama", "nemotron_h")
    }


@pytest.fixture
def gpu_code_path(kernel_switch: Callable[[str, str | None], None]) -> None:
    if DEVICE == "cpu":
        kernel_switch(FORCE_TRITON_ENV, "1")


def _decoding(manager: object, rid: str, prompt: list[int]) -> ScheduledSequence:
    """A request whose prompt is in the cache and whose next step is one token."""
    request = Request(rid, prompt, Params(), output_token_ids=[7])
    request.num_computed_tokens = len(prompt)
    assert manager.allocate_slots(rid, len(prompt) + 1)  # type: ignore[attr-defined]
    return ScheduledSequence.of(request, 1)


@pytest.mark.usefixtures("gpu_code_path")
@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_decode_step_reads_nothing_back(checkpoints: dict[str, Path], arch: str) -> None:
    runner, manager, _ = make_runner(checkpoints[arch], DEVICE, "v2")
    seqs = [_decoding(manager, f"r{i}", list(range(3, 3 + n))) for i, n in enumerate([5, 9, 2])]
    with count_host_reads(DEVICE) as reads, torch.inference_mode():
        batch = runner.build_batch(seqs)
        hidden = runner.model.forward(batch, runner.caches)
        runner.model.compute_logits(hidden[batch.logits_indices])
    assert reads.count == 0, reads.names


@pytest.mark.usefixtures("gpu_code_path")
def test_a_reintroduced_read_in_a_layer_is_counted(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same step with one layer reading a value back counts it in every such layer."""
    from models.layers import mamba2

    original = mamba2.Mamba2Mixer._step

    def reading_step(self: mamba2.Mamba2Mixer, xbc: torch.Tensor, *args: object) -> torch.Tensor:
        if bool(xbc.isnan().any()):
            raise AssertionError("nan")
        return original(self, xbc, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(mamba2.Mamba2Mixer, "_step", reading_step)
    runner, manager, _ = make_runner(checkpoints["nemotron_h"], DEVICE, "v2")
    seqs = [_decoding(manager, "r0", [3, 4, 5])]
    with count_host_reads(DEVICE) as reads, torch.inference_mode():
        runner.model.forward(runner.build_batch(seqs), runner.caches)
    num_mamba = len(runner.caches.mamba)
    assert reads.count >= num_mamba, reads.names


def _prompt(manager: object, rid: str, prompt: list[int]) -> ScheduledSequence:
    """A request whose whole prompt is this step's chunk, from position 0."""
    request = Request(rid, prompt, Params())
    assert manager.allocate_slots(rid, len(prompt))  # type: ignore[attr-defined]
    return ScheduledSequence.of(request, len(prompt))


@pytest.mark.usefixtures("gpu_code_path")
@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_prefill_step_of_unequal_prompts_reads_nothing_back(
    checkpoints: dict[str, Path], arch: str
) -> None:
    """Fresh prompts of unequal lengths run as one padded attention call; the
    tokens come back out of the padding without a boolean-mask index. What
    stays is one read per MoE layer: the grouped experts' segment bounds
    (`moe_experts_ref`), which size each expert's product."""
    runner, manager, _ = make_runner(checkpoints[arch], DEVICE, "v2")
    seqs = [_prompt(manager, f"r{i}", list(range(3, 3 + n))) for i, n in enumerate([5, 9, 2])]
    with count_host_reads(DEVICE) as reads, torch.inference_mode():
        batch = runner.build_batch(seqs)
        hidden = runner.model.forward(batch, runner.caches)
        runner.model.compute_logits(hidden[batch.logits_indices])
    num_moe = sum(isinstance(m, NemotronHMoE) for m in runner.model.modules())
    assert reads.names == ["Tensor.tolist"] * num_moe


def _continuing(manager: object, rid: str, prompt: list[int], done: int) -> ScheduledSequence:
    """A request whose first `done` prompt tokens are cached; this step brings the rest."""
    request = Request(rid, prompt, Params())
    request.num_computed_tokens = done
    assert manager.allocate_slots(rid, len(prompt))  # type: ignore[attr-defined]
    return ScheduledSequence.of(request, len(prompt) - done)


@pytest.mark.usefixtures("gpu_code_path")
def test_mixed_step_of_a_continued_chunk_and_decodes_reads_nothing_back(
    checkpoints: dict[str, Path],
) -> None:
    """A chunk continuing a cached prefix (its keys read back from the cache,
    one attention call per chunk) beside decode tokens and a fresh prompt."""
    runner, manager, _ = make_runner(checkpoints["llama"], DEVICE, "v2")
    seqs = [
        _continuing(manager, "c", list(range(3, 23)), done=7),
        _decoding(manager, "d", list(range(5, 14))),
        _prompt(manager, "p", list(range(4, 10))),
    ]
    with count_host_reads(DEVICE) as reads, torch.inference_mode():
        batch = runner.build_batch(seqs)
        hidden = runner.model.forward(batch, runner.caches)
        runner.model.compute_logits(hidden[batch.logits_indices])
    assert batch.shape.has_cached_tokens and len(batch.shape.chunk_seqs) == 2
    assert reads.count == 0, reads.names
