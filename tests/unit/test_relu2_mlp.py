"""The squared-ReLU MLP, prepacked and plain."""

from __future__ import annotations

import torch

from models.layers.relu2_mlp import Relu2MLP, relu2


def test_prepacked_mlp_equals_the_plain_layers() -> None:
    torch.manual_seed(0)
    mlp = Relu2MLP(64, 192)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            want = mlp.down_proj(relu2(mlp.up_proj(x)))
            mlp.fuse_projections()
            got = mlp(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_write_into_a_weight_after_packing_takes_the_plain_path() -> None:
    torch.manual_seed(1)
    mlp = Relu2MLP(32, 64)
    mlp.fuse_projections()
    x = torch.randn(5, 32)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)  # the packed copy is now stale
        assert mlp.up is not None and not mlp.up.is_current()
        torch.testing.assert_close(mlp(x), mlp.down_proj(relu2(mlp.up_proj(x))))
