"""The C Mamba2 decode-step kernel against its plain-torch twin."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from models.kernels import cpu_build, cpu_mamba_step, dispatch
from models.kernels.cpu_mamba_step import mamba_step, mamba_step_ref, supported

pytestmark = pytest.mark.skipif(
    cpu_build.load("mamba_step") is None, reason="no C compiler to build the CPU kernels"
)

NO_LIMIT = (0.0, float("inf"))


def _inputs(
    batch: int, heads: int, head_dim: int, groups: int, dstate: int, kernel: int, seed: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    width = heads * head_dim + 2 * groups * dstate
    # xbc and dt_raw are column slices of one in_proj output, as in the mixer.
    proj = torch.randn(batch, 5 + width + heads, generator=gen)
    slots = torch.randperm(2 * batch + 3, generator=gen)[:batch]
    return {
        "xbc": proj[:, 5 : 5 + width],
        "dt_raw": 3 * proj[:, 5 + width :],
        "conv_state": torch.randn(2 * batch + 3, width, kernel - 1, generator=gen),
        "ssm_state": torch.randn(2 * batch + 3, heads, head_dim, dstate, generator=gen),
        "slots": slots,
        "conv_weight": torch.randn(width, kernel, generator=gen),
        "conv_bias": torch.randn(width, generator=gen),
        "dt_bias": torch.randn(heads, generator=gen),
        "A": -torch.rand(heads, generator=gen) * 4,
        "D": torch.randn(heads, generator=gen),
        "n_groups": groups,
        "dt_limit": NO_LIMIT,
    }


def _both(args: dict[str, Any], **extra: Any) -> tuple[list[torch.Tensor], ...]:
    """(y, conv_state, ssm_state) of the kernel and of the twin, each on its own copy."""
    results = []
    for fn in (mamba_step, mamba_step_ref):
        mine: dict[str, Any] = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()
        }
        y = fn(**mine, **extra)
        results.append([y, mine["conv_state"], mine["ssm_state"]])
    return tuple(results)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("batch", "heads", "head_dim", "groups", "dstate", "kernel"),
    [(1, 4, 16, 2, 16, 4), (5, 8, 64, 4, 64, 4), (3, 6, 10, 3, 7, 3), (32, 16, 64, 4, 64, 4)],
)
def test_matches_the_torch_twin(
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    batch: int,
    heads: int,
    head_dim: int,
    groups: int,
    dstate: int,
    kernel: int,
) -> None:
    monkeypatch.setattr(cpu_mamba_step, "_PARALLEL_STATE", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    args = _inputs(batch, heads, head_dim, groups, dstate, kernel, seed=batch + heads)
    got, want = _both(args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-5)
    # Rows of the pool the step does not own stay as they were.
    untouched = torch.ones(args["ssm_state"].shape[0], dtype=torch.bool)
    untouched[args["slots"]] = False
    assert torch.equal(got[2][untouched], args["ssm_state"][untouched])


def test_out_slots_keep_the_rows_read() -> None:
    args = _inputs(4, 8, 16, 2, 16, 4, seed=3)
    slots: torch.Tensor = args["slots"]
    pool = args["ssm_state"].shape[0]
    free = torch.tensor([s for s in range(pool) if s not in slots.tolist()])[: len(slots)]
    got, want = _both(args, out_slots=free)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-5)
    assert torch.equal(got[1][slots], args["conv_state"][slots])
    assert torch.equal(got[2][slots], args["ssm_state"][slots])
    assert not torch.equal(got[2][free], args["ssm_state"][free])


def test_dt_limit_and_softplus_threshold_match() -> None:
    args = _inputs(6, 8, 16, 2, 16, 4, seed=5)
    dt_raw: torch.Tensor = args["dt_raw"]
    dt_raw[0, 0], dt_raw[1, 1] = 40.0, -40.0  # both sides of softplus' threshold
    args["dt_limit"] = (0.01, 0.5)
    got, want = _both(args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-5)


def test_strided_pools_are_written_through_their_views() -> None:
    args = _inputs(3, 4, 16, 2, 16, 4, seed=7)
    conv: torch.Tensor = args["conv_state"]
    ssm: torch.Tensor = args["ssm_state"]
    # One layer of pools that hold two layers per slot (the V2 layout).
    conv_pool = torch.stack([torch.randn_like(conv), conv], dim=1)
    ssm_pool = torch.stack([torch.randn_like(ssm), ssm], dim=1)
    other_layer = ssm_pool[:, 0].clone()
    want = mamba_step_ref(**args)  # on the contiguous pools, updated in place
    got = mamba_step(**dict(args, conv_state=conv_pool[:, 1], ssm_state=ssm_pool[:, 1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(conv_pool[:, 1], conv, rtol=0, atol=0)
    torch.testing.assert_close(ssm_pool[:, 1], ssm, rtol=1e-5, atol=2e-5)
    assert torch.equal(ssm_pool[:, 0], other_layer)


def test_other_tensors_fall_back_to_torch() -> None:
    args = _inputs(2, 4, 16, 2, 16, 4, seed=9)
    bf16 = dict(args, xbc=args["xbc"].bfloat16())
    grad = dict(args, conv_weight=args["conv_weight"].clone().requires_grad_())
    for case in (bf16, grad):
        kernel_args = {
            k: case[k] for k in ("xbc", "dt_raw", "conv_state", "ssm_state", "conv_weight")
        }
        assert not supported(**kernel_args)
        assert dispatch.cpu_mamba_decode_step(**case) is None
