"""The bigram rewiring of a tiny Nemotron-H with MTP layers, whose random
MTP layers would otherwise never predict its random backbone: the LM head
maps a token's embedding to the embedding of a fixed permutation of it, and
the MTP's input fusion passes the next token's embedding straight through.
The backbone then mostly continues token t with perm(t), its mixers (left
as they are) now and then pushing it elsewhere, and the MTP predicts
perm(token after): drafts are accepted and rejected both.

`rewire` changes a state dict's tensors in place (a loaded model's, or a
checkpoint's); `bigram_checkpoint` writes a rewired copy of a checkpoint
folder, for servers that load it from disk."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def rewire(tensors: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Rewire the tensors named `prefix + ...` (see the module docstring)."""
    with torch.no_grad():
        embedding = tensors[prefix + "backbone.embeddings.weight"]
        vocab, hidden = embedding.shape
        perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(vocab)
        tensors[prefix + "backbone.norm_f.weight"].fill_(1.0)
        rows = embedding[inverse]
        tensors[prefix + "lm_head.weight"].copy_(rows / rows.norm(dim=-1)[:, None])
        fusion = prefix + "mtp.layers.0.eh_proj.weight"
        if fusion in tensors:
            last = max(
                int(name.split(".")[2])
                for name in tensors
                if name.startswith(prefix + "mtp.layers.")
            )
            eye = torch.zeros(hidden, 2 * hidden)
            eye[:, :hidden] = torch.eye(hidden)
            tensors[fusion].copy_(eye)
            tensors[prefix + "mtp.layers.0.enorm.weight"].fill_(1.0)
            tensors[prefix + f"mtp.layers.{last}.final_layernorm.weight"].fill_(1.0)


def bigram_checkpoint(source: Path, out: Path) -> Path:
    """`out`: a copy of the checkpoint folder `source` with rewired weights."""
    shutil.copytree(source, out, dirs_exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    rewire(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
