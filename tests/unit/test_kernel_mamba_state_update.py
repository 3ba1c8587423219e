"""Mamba2 decode-step state update: Triton kernel vs torch twin vs a scalar loop."""

# ruff: noqa: E402  -- the interpreter switch must precede the kernel imports.
import os

import torch

if not torch.cuda.is_available():
    # Kernels are built when their module is imported: pick the interpreter first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math
from dataclasses import dataclass

import pytest

from models.kernels.mamba_state_update import (
    MambaShapeError,
    mamba_state_update,
    mamba_state_update_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
NUM_SLOTS, LAYERS = 7, 2


@dataclass(frozen=True)
class Case:
    nheads: int
    head_dim: int
    dstate: int
    ngroups: int
    slots: tuple[int, ...]


CASES = {
    "two_groups": Case(nheads=4, head_dim=20, dstate=12, ngroups=2, slots=(5, 0, 3)),
    "one_group": Case(nheads=3, head_dim=8, dstate=16, ngroups=1, slots=(2,)),
}


def _inputs(case: Case, dtype: torch.dtype, with_z: bool) -> dict[str, torch.Tensor | None]:
    batch = len(case.slots)
    heads, groups = (batch, case.nheads, case.head_dim), (batch, case.ngroups, case.dstate)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=DEVICE)

    return {
        "slot_indices": torch.tensor(case.slots, device=DEVICE),
        "x": rand(*heads).to(dtype),
        "dt": rand(batch, case.nheads).to(dtype),
        "dt_bias": rand(case.nheads),
        "A": -torch.rand(case.nheads, device=DEVICE) * 2.0,
        "B": rand(*groups).to(dtype),
        "C": rand(*groups).to(dtype),
        "D": rand(case.nheads),
        "z": rand(*heads).to(dtype) if with_z else None,
    }


def _state_pool(case: Case) -> torch.Tensor:
    """One layer's view of a V2-style Mamba buffer `[slots, layers, H, P, N]`."""
    shape = (NUM_SLOTS, LAYERS, case.nheads, case.head_dim, case.dstate)
    return torch.randn(shape, device=DEVICE)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize(("with_z", "dt_limit"), [(False, (0.0, math.inf)), (True, (0.05, 0.8))])
def test_kernel_matches_reference(
    dtype: torch.dtype, case_name: str, with_z: bool, dt_limit: tuple[float, float]
) -> None:
    case = CASES[case_name]
    torch.manual_seed(0)
    inputs = _inputs(case, dtype, with_z)
    pool = _state_pool(case)
    by_kernel, by_ref = pool.clone(), pool.clone()

    y = mamba_state_update(by_kernel[:, 1], **inputs, dt_limit=dt_limit)  # type: ignore[arg-type]
    y_ref = mamba_state_update_ref(by_ref[:, 1], **inputs, dt_limit=dt_limit)  # type: ignore[arg-type]

    assert y.dtype == dtype and y.shape == (len(case.slots), case.nheads, case.head_dim)
    torch.testing.assert_close(y.float(), y_ref.float(), **TOLERANCES[dtype])
    torch.testing.assert_close(by_kernel, by_ref, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(NUM_SLOTS, LAYERS, dtype=torch.bool)
    untouched[list(case.slots), 1] = False
    assert torch.equal(by_kernel[untouched], pool[untouched])
    assert not torch.equal(by_kernel[case.slots[0], 1], pool[case.slots[0], 1])


def _scalar_step(
    state: torch.Tensor, inputs: dict[str, torch.Tensor | None], b: int, h: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one (sequence, head), written out element by element."""
    x, dt, B, C = inputs["x"], inputs["dt"], inputs["B"], inputs["C"]
    dt_bias, A, D, z = inputs["dt_bias"], inputs["A"], inputs["D"], inputs["z"]
    assert x is not None and dt is not None and B is not None and C is not None
    assert dt_bias is not None and A is not None and D is not None and z is not None
    step = min(max(math.log1p(math.exp(float(dt[b, h]) + float(dt_bias[h]))), 0.05), 0.8)
    decay = math.exp(step * float(A[h]))
    new = state.clone()
    y = torch.zeros(state.shape[0])
    for p in range(state.shape[0]):
        for n in range(state.shape[1]):
            new[p, n] = state[p, n] * decay + step * float(x[b, h, p]) * float(B[b, group, n])
            y[p] += float(new[p, n]) * float(C[b, group, n])
        zp = float(z[b, h, p])
        y[p] = (y[p] + float(D[h]) * float(x[b, h, p])) * zp / (1.0 + math.exp(-zp))
    return new, y


def test_reference_follows_the_recurrence_element_by_element() -> None:
    case = CASES["two_groups"]
    torch.manual_seed(2)
    inputs = _inputs(case, torch.float32, with_z=True)
    pool = _state_pool(case)[:, 0].contiguous()
    before = pool.clone()
    y = mamba_state_update_ref(pool, **inputs, dt_limit=(0.05, 0.8))  # type: ignore[arg-type]
    heads_per_group = case.nheads // case.ngroups
    for b, slot in enumerate(case.slots):
        for h in range(case.nheads):
            new, y_bh = _scalar_step(before[slot, h], inputs, b, h, h // heads_per_group)
            torch.testing.assert_close(pool[slot, h], new, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y[b, h], y_bh, atol=1e-4, rtol=1e-4)


def test_without_softplus_dt_is_used_as_given() -> None:
    case = CASES["one_group"]
    inputs = _inputs(case, torch.float32, with_z=False)
    inputs["dt"] = torch.full((1, case.nheads), -0.5, device=DEVICE)
    inputs["dt_bias"] = torch.full((case.nheads,), 0.75, device=DEVICE)
    pool = torch.zeros(NUM_SLOTS, case.nheads, case.head_dim, case.dstate, device=DEVICE)
    mamba_state_update(pool, **inputs, dt_softplus=False)  # type: ignore[arg-type]
    x, B = inputs["x"], inputs["B"]
    assert x is not None and B is not None
    # From a zero state the new state is dt * x B^T with dt = -0.5 + 0.75.
    expected = 0.25 * x[0, :, :, None] * B[0, 0][None, None, :]
    torch.testing.assert_close(pool[case.slots[0]], expected, atol=1e-6, rtol=1e-5)


def test_rejects_heads_not_divisible_by_groups() -> None:
    case = Case(nheads=3, head_dim=4, dstate=4, ngroups=2, slots=(0,))
    inputs = _inputs(case, torch.float32, with_z=False)
    pool = torch.zeros(1, 3, 4, 4, device=DEVICE)
    with pytest.raises(MambaShapeError, match="not a multiple of ngroups"):
        mamba_state_update(pool, **inputs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", [mamba_state_update, mamba_state_update_ref])
def test_out_slots_take_the_new_state_and_the_read_slots_keep_theirs(kernel: object) -> None:
    """A verify step reads one slot and writes another: the result equals an
    in-place update of a copy, and the slot read is left as it was."""
    case = CASES["two_groups"]
    torch.manual_seed(3)
    inputs = _inputs(case, torch.float32, with_z=False)
    pool = _state_pool(case)
    out_slots = torch.tensor([1, 6, 4], device=DEVICE)
    in_place, moved = pool.clone(), pool.clone()
    y_in_place = mamba_state_update_ref(in_place[:, 0], **inputs)  # type: ignore[arg-type]
    y = kernel(moved[:, 0], **inputs, out_slot_indices=out_slots)  # type: ignore[operator]
    torch.testing.assert_close(y, y_in_place, atol=1e-5, rtol=1e-5)
    for read, written in zip(case.slots, out_slots.tolist(), strict=True):
        torch.testing.assert_close(moved[written, 0], in_place[read, 0], atol=1e-5, rtol=1e-5)
        assert torch.equal(moved[read, 0], pool[read, 0])
    untouched = torch.ones(NUM_SLOTS, LAYERS, dtype=torch.bool)
    untouched[out_slots.tolist(), 0] = False
    assert torch.equal(moved[untouched], pool[untouched])
