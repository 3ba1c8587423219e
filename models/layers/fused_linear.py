"""Several `nn.Linear` layers over the same input, run as one matmul.

Checkpoints store Q/K/V (and gate/up) as separate tensors and the modules keep
their Hugging Face names so weights load by name. After loading, `FusedLinear`
moves the layers' weights into one `[sum(out_features), in_features]` tensor
and re-points every layer's `weight` (and `bias`) at its rows of it: no extra
memory, one matmul per step instead of several, and writes through a layer's
parameter (a later `load_weights`) still land in the fused tensor.

    fused weight  [ q rows | k rows | v rows ]
    q_proj.weight = fused[0:q]   k_proj.weight = fused[q:q+k]   ...   (views)

Anything that gives a layer a new tensor (`model.to(...)` across dtypes or
devices, assigning a parameter) breaks the sharing; `is_current()` detects it
and callers then run the layers one by one, which is always correct.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class FusedLinear:
    """One matmul for `linears`, which must share `in_features`, dtype and device.

    Not an `nn.Module`: it owns no parameters of its own, only the storage
    the layers' parameters now view, so `state_dict()` and `named_parameters()`
    keep the checkpoint's names and shapes.
    """

    def __init__(self, linears: Sequence[torch.nn.Linear]) -> None:
        if not linears:
            raise ValueError("FusedLinear needs at least one layer")
        in_features = {layer.in_features for layer in linears}
        has_bias = {layer.bias is not None for layer in linears}
        if len(in_features) != 1 or len(has_bias) != 1:
            raise ValueError(
                "fused layers must share in_features and all have a bias or none; got "
                + ", ".join(f"({lin.in_features}, bias={lin.bias is not None})" for lin in linears)
            )
        self.linears = list(linears)
        self.out_features = [layer.out_features for layer in linears]
        with torch.no_grad():
            self.weight = torch.cat([layer.weight.detach() for layer in linears])
            self.bias = (
                torch.cat([layer.bias.detach() for layer in linears if layer.bias is not None])
                if has_bias == {True}
                else None
            )
            self._point_layers_at_fused_storage()

    def _point_layers_at_fused_storage(self) -> None:
        start = 0
        for layer, rows in zip(self.linears, self.out_features, strict=True):
            layer.weight = torch.nn.Parameter(self.weight[start : start + rows], False)
            if self.bias is not None:
                layer.bias = torch.nn.Parameter(self.bias[start : start + rows], False)
            start += rows

    def is_current(self) -> bool:
        """Whether every layer's weight still views the fused tensor, at its rows."""
        row_bytes = self.weight.stride(0) * self.weight.element_size()
        expected = self.weight.data_ptr()
        for layer, rows in zip(self.linears, self.out_features, strict=True):
            if layer.weight.data_ptr() != expected or layer.weight.dtype != self.weight.dtype:
                return False
            expected += rows * row_bytes
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., sum(out_features)]`: the layers' outputs side by side, in order."""
        return F.linear(x, self.weight, self.bias)
