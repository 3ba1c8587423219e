"""Part 1: our models against transformers on the same device and weights.

For Llama, Nemotron-H (Mamba2, attention, MLP and MoE layers) and the Omni
VL wrapper: prefill a prompt, decode greedily one token per step through the
engine's batch builder and the paged cache, and compare every logit row
(prompt positions and decode steps) with transformers' forward over the
whole sequence. fp32: the largest difference relative to the largest
reference logit must stay within 1e-4 and the greedy tokens must agree.
bf16: the share of positions where our greedy token equals transformers'
argmax over the same sequence is reported. On CUDA the dense model's decode
steps replay captured CUDA graphs (the hybrids never capture, see
`engine.decode_graphs`), so both dtypes check the graphs too; under
`--device cpu` those are listed as needing CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.engine_setup import OMNI, build_engine, checkpoint, greedy
from benchmarks.gpu_check.report import failure_row, needs_cuda
from engine.request import Request
from engine.scheduler import ScheduledSequence

ARCHS = ("llama", "nemotron_h", "nemotron_vl")
PARITY_TOLERANCE = 1e-4
PROMPTS = ([1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [1, 300, 301, 7, 9])
# Architectures whose decode steps run from CUDA graphs on a GPU.
GRAPH_ARCHS = ("llama",)


def _our_logits(engine: Any, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits `[len(prompt) + steps - 1, vocab]` and the `steps` greedy tokens."""
    runner, model = engine.runner, engine.model
    request = Request("parity", list(prompt), greedy(steps))
    assert engine.manager.allocate_slots("parity", len(prompt) + steps)
    rows: list[torch.Tensor] = []
    chunk = len(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            batch = runner.build_batch([ScheduledSequence.of(request, chunk)])
            hidden = runner.graphs.run(batch) if runner.graphs is not None else None
            if hidden is None:  # a prefill, or no graphs captured
                hidden = model.forward(batch, runner.caches)
            logits = model.compute_logits(hidden).float()
            rows.append(logits)
            request.num_computed_tokens += chunk
            request.append_output(int(logits[-1].argmax()))
            chunk = 1
    engine.manager.free("parity")
    return torch.cat(rows), request.output_token_ids


def _reference(path: Path, arch: str, device: str, dtype: torch.dtype) -> Any:
    if arch == "nemotron_vl":
        from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

        model = NemotronH_Omni_Reasoning_V3.from_pretrained(path, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def _compare(engine: Any, reference: Any, steps: int, device: str) -> dict[str, Any]:
    worst, agree, total = 0.0, 0, 0
    for prompt in PROMPTS:
        ours, tokens = _our_logits(engine, prompt, steps)
        ids = torch.tensor([prompt + tokens[:-1]], device=device)
        with torch.no_grad():
            theirs = reference(input_ids=ids).logits[0].float()
        worst = max(worst, float((ours - theirs).abs().max() / theirs.abs().max()))
        their_tokens = theirs[len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(int(a == b) for a, b in zip(their_tokens, tokens, strict=True))
        total += len(tokens)
    replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    return {
        "max_rel_logit_error": worst,
        "greedy_agreement": agree / total,
        "graph_replays": replays,
    }


def check_models(root: Path, device: str, steps: int) -> list[dict[str, Any]]:
    """One row per (architecture, dtype)."""
    rows = []
    for arch in ARCHS:
        for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            row: dict[str, Any] = {"arch": OMNI if arch == "nemotron_vl" else arch, "dtype": dtype}
            try:  # the checkpoint too: writing the VL one needs its transformers class
                path = checkpoint(root, arch, "tiny")
                graphs = (1,) if device == "cuda" and arch in GRAPH_ARCHS else ()
                engine = build_engine(
                    path, device, dtype, num_blocks=64, block_size=16, graph_batch_sizes=graphs
                )
                reference = _reference(path, arch, device, torch_dtype)
                row.update(_compare(engine, reference, steps, device))
            except Exception as error:  # e.g. a transformers without this class
                rows.append({**row, **failure_row(error)})
                continue
            if dtype == "float32":
                row["ok"] = (
                    row["max_rel_logit_error"] <= PARITY_TOLERANCE
                    and row["greedy_agreement"] == 1.0
                )
            else:  # reported, not required: bf16 rounding may flip near ties
                row["ok"] = True
            if graphs:  # every decode step replayed a graph
                row["ok"] = row["ok"] and row["graph_replays"] == len(PROMPTS) * (steps - 1)
            rows.append(row)
            del engine, reference
    if device != "cuda":
        rows += [
            needs_cuda("decode steps replayed from CUDA graphs", arch=arch, dtype=dtype)
            for arch in GRAPH_ARCHS
            for dtype in ("float32", "bfloat16")
        ]
    return rows
