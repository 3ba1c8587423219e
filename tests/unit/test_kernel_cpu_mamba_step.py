"""The C Mamba2 step kernel against its plain-torch twins: decode steps
against `mamba_step_ref`, prompt chunks against that twin stepped token by
token and against the mixer's chunked scan (`models.layers.ssd`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from models.kernels import cpu_build, cpu_mamba_step, dispatch
from models.kernels.cpu_mamba_step import (
    MambaStepWeights,
    mamba_scan_if_supported,
    mamba_step,
    mamba_step_ref,
    supported,
)
from models.layers.mamba2 import causal_conv_chunk
from models.layers.ssd import ssd_chunked_scan

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
        "weights": MambaStepWeights(
            conv_weight=torch.randn(width, kernel, generator=gen),
            conv_bias=torch.randn(width, generator=gen),
            dt_bias=torch.randn(heads, generator=gen),
            A=-torch.rand(heads, generator=gen) * 4,
            D=torch.randn(heads, generator=gen),
            n_groups=groups,
            dt_limit=NO_LIMIT,
        ),
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
    args["weights"] = dataclasses.replace(args["weights"], dt_limit=(0.01, 0.5))
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
    weights: MambaStepWeights = args["weights"]
    bf16 = dict(args, xbc=args["xbc"].bfloat16())
    grad_weights = dataclasses.replace(
        weights, conv_weight=weights.conv_weight.clone().requires_grad_()
    )
    grad = dict(args, weights=grad_weights)
    for case in (bf16, grad):
        tensors = [case[k] for k in ("xbc", "dt_raw", "conv_state", "ssm_state")]
        assert not supported(*tensors, case["weights"].conv_weight)
        assert dispatch.cpu_mamba_decode_step(**case) is None


def _chunks(
    lengths: list[int],
    heads: int,
    head_dim: int,
    groups: int,
    dstate: int,
    seed: int,
    kernel: int = 4,
) -> dict[str, Any]:
    """Prompt chunks of `lengths` tokens, rows packed one after another with
    a decode row between them (rows the scan must leave alone)."""
    total = sum(lengths) + len(lengths)
    args = _inputs(total, heads, head_dim, groups, dstate, kernel, seed)
    rows, at = [], 0
    for n in lengths:
        rows.append((at, at + n))
        at += n + 1
    args["slots"] = args["slots"][: len(lengths)].tolist()
    args["rows"] = rows
    return args


def _stepped(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode twin run token by token: (y, conv_state, ssm_state)."""
    conv, ssm = args["conv_state"].clone(), args["ssm_state"].clone()
    y = torch.zeros(args["xbc"].shape[0], *ssm.shape[1:3])
    for slot, (begin, end) in zip(args["slots"], args["rows"], strict=True):
        for r in range(begin, end):
            index = torch.tensor([slot])
            y[r] = mamba_step_ref(
                args["xbc"][r : r + 1], args["dt_raw"][r : r + 1], conv, ssm, index, args["weights"]
            )[0]
    return y, conv, ssm


def _scanned(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    conv, ssm = args["conv_state"].clone(), args["ssm_state"].clone()
    y = torch.zeros(args["xbc"].shape[0], *ssm.shape[1:3])
    done = mamba_scan_if_supported(
        args["xbc"], args["dt_raw"], conv, ssm, args["slots"], args["rows"], args["weights"], y
    )
    assert done
    return y, conv, ssm


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("lengths", "heads", "head_dim", "groups", "dstate", "kernel"),
    [
        ([1], 4, 16, 2, 16, 4),
        ([7, 1, 30], 8, 16, 4, 16, 4),
        ([64, 33], 16, 64, 4, 64, 4),
        # Chunks shorter than the conv window: their taps and the conv state
        # left behind come partly from the state before them.
        ([2, 3, 5], 8, 16, 4, 16, 4),
        ([2, 9], 4, 16, 2, 16, 2),
        ([3, 4, 40], 4, 16, 2, 16, 6),
    ],
)
def test_prompt_chunks_run_the_recurrence_token_by_token(
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    lengths: list[int],
    heads: int,
    head_dim: int,
    groups: int,
    dstate: int,
    kernel: int,
) -> None:
    monkeypatch.setattr(cpu_mamba_step, "_PARALLEL_STATE", 0 if threads > 1 else 1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    args = _chunks(lengths, heads, head_dim, groups, dstate, len(lengths) + heads, kernel)
    got, want = _scanned(args), _stepped(args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    between = [end for _, end in args["rows"]]  # the decode rows between chunks
    assert torch.equal(got[0][between], torch.zeros_like(got[0][between]))


def test_prompt_chunks_equal_the_chunked_scan() -> None:
    """The mixer's torch path for the same chunks: conv over the chunk, then
    the SSD chunked scan from the slot's state, plus the D skip."""
    args = _chunks([50, 17], 8, 32, 2, 32, seed=11)
    got_y, got_conv, got_ssm = _scanned(args)
    w: MambaStepWeights = args["weights"]
    heads, head_dim = args["ssm_state"].shape[1:3]
    conv, ssm = args["conv_state"].clone(), args["ssm_state"].clone()
    for slot, (begin, end) in zip(args["slots"], args["rows"], strict=True):
        out, conv[slot] = causal_conv_chunk(
            args["xbc"][begin:end], conv[slot], w.conv_weight, w.conv_bias
        )
        x, B, C = torch.nn.functional.silu(out).split(
            [heads * head_dim, w.n_groups * 32, w.n_groups * 32], -1
        )
        dt = torch.nn.functional.softplus(args["dt_raw"][begin:end] + w.dt_bias)
        y, ssm[slot] = ssd_chunked_scan(
            x.reshape(-1, heads, head_dim),
            dt,
            w.A,
            B.reshape(-1, w.n_groups, 32),
            C.reshape(-1, w.n_groups, 32),
            16,
            initial_state=ssm[slot],
        )
        want = y + x.reshape(-1, heads, head_dim) * w.D[:, None]
        torch.testing.assert_close(got_y[begin:end], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_conv, conv, rtol=0, atol=0)
    torch.testing.assert_close(got_ssm, ssm, rtol=1e-4, atol=1e-4)
