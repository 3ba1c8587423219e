"""transformers' greedy continuation, the reference served answers are held to."""

from __future__ import annotations

import torch


def full_forward_greedy(
    model: torch.nn.Module, prompt: list[int], new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, each from a full forward of the
    sequence so far (transformers' cached one-token path of Nemotron-H clamps
    the Mamba time step differently, see `models/layers/mamba2.py`)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            scores = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(scores.argmax()))
            logprobs.append(float(scores[ids[-1]]))
    return ids[len(prompt) :], logprobs
