"""`nn.Linear` layers over the same input, run as one (prepacked) matmul.

Checkpoints store Q/K/V (and gate/up) as separate tensors and the modules keep
their Hugging Face names so weights load by name. After loading, `FusedLinear`
moves the layers' weights into one `[sum(out_features), in_features]` tensor
and re-points every layer's `weight` (and `bias`) at its rows of it: no extra
memory, one matmul per step instead of several, and writes through a layer's
parameter (a later `load_weights`) still land in the fused tensor.

    fused weight  [ q rows | k rows | v rows ]
    q_proj.weight = fused[0:q]   k_proj.weight = fused[q:q+k]   ...   (views)

A single layer is wrapped as is (its weight is not moved, so a tied
`lm_head` stays tied). On CPU (fp32, bf16, fp16) the fused weight is also
reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`), which streams from memory far
better than the row-major layout when a decode step reads every weight once,
and keeps the cores' vector units busier in a prefill: about 1.5x faster
matmuls in bf16 on a small model, and 1.5-3.5x in fp32 against `F.linear`
(hidden 256, 8 to 2,048 rows). The blocked copy costs a second copy of those
weights in host memory. In fp32 oneDNN accumulates in another order than
`F.linear`: outputs differ in the last bits (about 3e-6 relative), well inside
the parity tests' tolerance against `transformers`.

In fp32 a product of a few rows (a decode step of a few sequences) may take
one of two other paths where that is faster: the row-major weight through
`F.linear` (torch's BLAS, MKL in the CPU wheels), or the C kernel of
`models.kernels.cpu_skinny_gemm` on the row-major weight (up to
`FEW_ROWS_MAX` rows). Which is fastest depends on the CPU: the loader
measures the paths on the model's own products
(`models.layers.small_products`) and sets `few_row_paths`, the path per row
count. A model too small to time keeps `DEFAULT_FEW_ROW_PATHS`: the
row-major path up to `ROW_MAJOR_MAX_ROWS` rows (measured per CPU with
`python -m benchmarks.linear_paths`; `benchmarks/README.md` has the figures).

Every product uses all of torch's threads: a memory-bound product wants every
core's bandwidth, and running small products on the calling thread alone
made them slower on a host where one thread streams well under half of what
two do.

Anything that gives a layer a new tensor (`model.to(...)` across dtypes or
devices, assigning a parameter) or writes into a weight after packing makes
the fusion stale; `is_current()` detects it and callers then run the layers
one by one, which is always correct.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models.kernels import cpu_skinny_gemm

# Dtypes whose matmuls run prepacked through oneDNN on CPU.
_PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The step size the blocked layout is tuned for; any row count still works.
_PACK_BATCH_HINT = 32
# The paths of a product (`FusedLinear.run_path`).
BLOCKED, ROW_MAJOR, SKINNY = "blocked", "row-major", "skinny"
# The most rows of an fp32 product that may run on the row-major weight
# through `F.linear`, and through the few-row kernel (`cpu_skinny_gemm`).
ROW_MAJOR_MAX_ROWS = 3
FEW_ROWS_MAX = cpu_skinny_gemm.MAX_ROWS
# The paths of fp32 products of 1, 2, ... rows until the loader measures
# them (`models.layers.small_products`); more rows take the blocked copy.
DEFAULT_FEW_ROW_PATHS = (ROW_MAJOR,) * ROW_MAJOR_MAX_ROWS


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
        self.bias: torch.Tensor | None
        with torch.no_grad():
            if len(linears) == 1:
                self.weight = linears[0].weight.detach()
                bias = linears[0].bias
                self.bias = bias.detach() if bias is not None else None
            else:
                self.weight = torch.cat([layer.weight.detach() for layer in linears])
                self.bias = (
                    torch.cat([lin.bias.detach() for lin in linears if lin.bias is not None])
                    if has_bias == {True}
                    else None
                )
                self._point_layers_at_fused_storage()
            self.packed = _pack_for_cpu(self.weight)
        self._expected = self._stamps()  # what `is_current` compares against
        # The path of a product of 1, 2, ... rows (fp32 only; beyond, the
        # blocked copy); `small_products.choose_few_row_paths` sets it for this CPU.
        fp32 = self.weight.dtype == torch.float32
        self.few_row_paths: tuple[str, ...] = DEFAULT_FEW_ROW_PATHS if fp32 else ()

    def _point_layers_at_fused_storage(self) -> None:
        start = 0
        for layer, rows in zip(self.linears, self.out_features, strict=True):
            layer.weight = torch.nn.Parameter(self.weight[start : start + rows], False)
            if self.bias is not None:
                layer.bias = torch.nn.Parameter(self.bias[start : start + rows], False)
            start += rows

    def is_current(self) -> bool:
        """Whether every layer's weight still views the fused tensor, at its
        rows, unchanged since fusion (the packed copy is a snapshot).

        Runs before every product (over a hundred per decode step), so it
        compares precomputed stamps rather than recomputing row offsets.
        """
        return self._stamps() == self._expected

    def _stamps(self) -> list[tuple[int, torch.dtype, int]]:
        """Per layer: its weight's address (its rows of the fused tensor),
        dtype and, where a packed snapshot exists, version counter."""
        packed = self.packed is not None
        weights = [layer._parameters["weight"] for layer in self.linears]
        return [
            (w.data_ptr(), w.dtype, w._version if packed else 0) for w in weights if w is not None
        ]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., sum(out_features)]`: the layers' outputs side by side, in order."""
        if self.packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return self.run_path(x, self.path_for(x))

    def path_for(self, x: torch.Tensor) -> str:
        """The path a packed fusion multiplies `x` on: by its row count, from
        `few_row_paths` (see the module docstring), else the blocked copy."""
        rows = x.numel() // max(x.shape[-1], 1)
        return self.few_row_paths[rows - 1] if 0 < rows <= len(self.few_row_paths) else BLOCKED

    def run_path(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """`x` times the weight on `path` (only where `packed` exists); the
        few-row kernel falls back to the blocked copy where it does not serve `x`."""
        if path == ROW_MAJOR:
            return F.linear(x, self.weight, self.bias)
        if path == SKINNY:
            rows = x.reshape(-1, x.shape[-1])
            out = cpu_skinny_gemm.skinny_gemm_if_supported(rows, self.weight, self.bias)
            if out is not None:
                return out.view(*x.shape[:-1], out.shape[-1])
        return self.packed_matmul(x)

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x` times the blocked copy (only where `packed` exists)."""
        assert self.packed is not None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of `weight`, or None where it does not apply."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in _PACKED_DTYPES
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
