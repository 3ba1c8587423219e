"""A mixture-of-experts layer's experts on CPU, every chosen expert and the
shared expert in one call, through the C kernel in `csrc/moe_experts.c`:

    out[t] = sum_j weights[t, j] * down[e] relu2(up[e] x[t])   e = experts[t, j]
             (+ shared_down relu2(shared_up x[t]))

`up [E, I, H]` and `down [E, H, I]` stack the routed experts' weights. The
kernel sorts the (token, j) pairs by expert and runs each chosen expert once
on its rows; an expert no token chose is never read, and no Python loop runs
over the experts. `moe_experts_ref` is the plain-torch twin: the same sort,
then one product per expert with rows (the segment bounds read once).
`supported(...)` says whether tensors can take the kernel (fp32 CPU
tensors, contiguous weights, no autograd, the library built); otherwise
callers run the twin.

The kernel's tiles read 8 / 6 / 4 / 3 weight rows side by side for groups
of 1 / 2 / 3 / 4 input rows (each fits AVX2's 16 vector registers); the
measurement behind them is in benchmarks/README.md.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from models.kernels import cpu_build

# Below this many weight values read, one thread is faster than starting more.
_PARALLEL_WEIGHTS = 1 << 16
# Output rows per work item: a multiple of the kernel's block (24 rows).
_CHUNK = 48

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class MoEKernelError(RuntimeError):
    """The MoE experts' kernel refused its inputs."""


_KERNEL = cpu_build.KernelFunction(
    "moe_experts",
    "moe_experts",
    [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _INT],
)

SharedExpert = tuple[torch.Tensor, torch.Tensor]  # (up [S, H], down [H, S])


def available() -> bool:
    """Whether the kernel library can be had on this machine (built, not turned off)."""
    return _KERNEL.get() is not None


def supported(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    shared: SharedExpert | None,
) -> bool:
    """Whether `moe_experts_if_supported(...)` runs the C kernel."""
    matrices = [up, down, *(shared or ())]
    if x.dtype != torch.float32 or any(w.dtype != torch.float32 for w in matrices):
        return False
    if experts.dtype != torch.int64 or weights.dtype != torch.float32:
        return False
    if not all(t.is_cpu for t in (x, experts, weights, *matrices)):
        return False
    if x.dim() != 2 or x.stride(1) != 1 or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        return False
    if weights.shape != experts.shape or not (experts.is_contiguous() and weights.is_contiguous()):
        return False
    num_experts, inter, hidden = up.shape
    if x.shape[1] != hidden or down.shape != (num_experts, hidden, inter):
        return False
    if shared is not None and shared[1].shape != (hidden, shared[0].shape[0]):
        return False
    if shared is not None and shared[0].shape[1] != hidden:
        return False
    if not all(w.is_contiguous() for w in matrices):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *matrices)):
        return False  # the kernel records no autograd graph
    return _KERNEL.get() is not None


def moe_experts_if_supported(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor | None:
    """`x [T, H]`, `experts [T, top_k]` (int64 ids), `weights [T, top_k]` ->
    `[T, H]` float32; None (nothing done) where `supported(...)` does not hold."""
    kernel = _KERNEL.get()
    if kernel is None or not supported(x, experts, weights, up, down, shared):
        return None
    tokens, top_k = experts.shape
    num_experts, inter, hidden = up.shape
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    if tokens == 0:
        return out
    shared_inter = 0 if shared is None else shared[0].shape[0]
    # Each pair reads at most one expert: this bounds the weights a step reads.
    reads = tokens * hidden * (top_k * 2 * inter + 2 * shared_inter)
    threads = torch.get_num_threads() if reads >= _PARALLEL_WEIGHTS else 1
    status = kernel(
        x.data_ptr(),
        x.stride(0),
        tokens,
        hidden,
        experts.data_ptr(),
        weights.data_ptr(),
        top_k,
        up.data_ptr(),
        down.data_ptr(),
        num_experts,
        inter,
        None if shared is None else shared[0].data_ptr(),
        None if shared is None else shared[1].data_ptr(),
        shared_inter,
        out.data_ptr(),
        out.stride(0),
        _CHUNK,
        threads,
    )
    if status != 0:
        reason = {1: "bad sizes or an expert id out of range", 2: "threads", 3: "out of memory"}
        raise MoEKernelError(f"the MoE experts' kernel failed ({reason.get(status, status)})")
    return out


def moe_experts_ref(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """The plain-torch twin of `moe_experts_if_supported`, in `x`'s dtype: the
    routed sum in float32, cast, plus the shared expert. Reads the segment
    bounds from the device once."""
    num_tokens, top_k = experts.shape
    flat = experts.flatten()
    # Stable: within an expert the pairs stay in token order, so the sum
    # below adds them in the order of the per-expert reference loop.
    order = flat.argsort(stable=True)
    tokens = order.div(top_k, rounding_mode="floor")
    # offsets[e]: the pairs that chose an expert below e (bincount would read
    # the device on CUDA to size its output).
    expert_ids = torch.arange(up.shape[0] + 1, device=flat.device)
    bounds = torch.searchsorted(flat[order], expert_ids).tolist()
    rows = x[tokens]
    out_rows = rows.new_empty(rows.shape)
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end > start:
            hidden = F.linear(rows[start:end], up[expert])
            out_rows[start:end] = F.linear(F.relu(hidden).square_(), down[expert])
    weighted = out_rows * weights.flatten()[order, None]
    routed = torch.zeros(num_tokens, x.shape[1], dtype=weighted.dtype, device=x.device)
    out = routed.index_add_(0, tokens, weighted).to(x.dtype)
    if shared is not None:
        out = out + F.linear(F.relu(F.linear(x, shared[0])).square_(), shared[1])
    return out
