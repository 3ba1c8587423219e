"""Dispatch: reference on CPU, Triton kernel on CUDA or when DISAGG_FORCE_TRITON=1."""

# ruff: noqa: E402  -- the interpreter switch must precede the kernel imports.
import os

import torch

if not torch.cuda.is_available():
    # Kernels are built when their module is imported: pick the interpreter first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from models.kernels import block_copy, dispatch, paged_attention
from models.kernels import mamba_state_update as mamba_kernel

CPU = torch.device("cpu")


def _record_calls(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: list[str], calls: list[str]
) -> None:
    """Wrap `module.<name>` so each call appends its name to `calls`, then runs the real one."""
    for name in names:
        real: Callable[..., Any] = getattr(module, name)

        def wrapper(*args: Any, _real: Callable[..., Any] = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, name, wrapper)


def _attention_args() -> tuple[Any, ...]:
    pool = torch.randn(5, 2, 4, 2, 8)
    q = torch.randn(2, 4, 8)
    tables = torch.tensor([[3, 1], [4, 0]])
    return q, pool[:, 0], pool[:, 1], tables, torch.tensor([7, 2]), 0.5


def _mamba_args() -> tuple[Any, ...]:
    state = torch.randn(3, 2, 4, 8)
    x = torch.randn(2, 2, 4)
    bc = torch.randn(2, 1, 8)
    return (
        state,
        torch.tensor([2, 0]),
        x,
        torch.randn(2, 2),
        torch.zeros(2),
        -torch.ones(2),
        bc,
        bc,
        torch.ones(2),
    )


def _run_all() -> dict[str, torch.Tensor]:
    pool = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    staging = dispatch.gather_blocks(pool, [4, 1])
    dispatch.scatter_blocks(pool, [0, 5], staging)
    dispatch.copy_blocks(pool, [2], pool, [3])
    return {
        "attention": dispatch.paged_attention_decode(*_attention_args()),
        "mamba": dispatch.mamba_state_update(*_mamba_args()),
        "pool": pool,
    }


def _spies(monkeypatch: pytest.MonkeyPatch, suffix: str) -> list[str]:
    """Record calls of every kernel (suffix "") or every reference (suffix "_ref")."""
    calls: list[str] = []
    _record_calls(monkeypatch, paged_attention, [f"paged_attention_decode{suffix}"], calls)
    _record_calls(monkeypatch, mamba_kernel, [f"mamba_state_update{suffix}"], calls)
    names = [f"{op}_blocks{suffix}" for op in ("gather", "scatter", "copy")]
    _record_calls(monkeypatch, block_copy, names, calls)
    return calls


def test_cpu_tensors_run_the_reference(
    monkeypatch: pytest.MonkeyPatch, kernel_switch: Callable[[str, str | None], None]
) -> None:
    kernel_switch(dispatch.FORCE_TRITON_ENV, None)
    kernel_calls, ref_calls = _spies(monkeypatch, ""), _spies(monkeypatch, "_ref")
    _run_all()
    assert kernel_calls == []
    assert sorted(ref_calls) == sorted(
        ["paged_attention_decode_ref", "mamba_state_update_ref"]
        + ["gather_blocks_ref", "scatter_blocks_ref", "copy_blocks_ref"]
    )


def test_force_triton_runs_the_kernels_on_cpu_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch, kernel_switch: Callable[[str, str | None], None]
) -> None:
    if torch.cuda.is_available() and not dispatch.kernels_interpreted():
        pytest.skip("kernels are compiled for CUDA in this process; CPU forcing is covered below")
    torch.manual_seed(0)
    kernel_switch(dispatch.FORCE_TRITON_ENV, None)
    by_reference = _run_all()
    kernel_switch(dispatch.FORCE_TRITON_ENV, "1")
    kernel_calls, ref_calls = _spies(monkeypatch, ""), _spies(monkeypatch, "_ref")
    torch.manual_seed(0)
    by_kernel = _run_all()
    assert ref_calls == []
    assert len(kernel_calls) == 5
    for name, want in by_reference.items():
        torch.testing.assert_close(by_kernel[name], want, atol=1e-5, rtol=1e-5)


def test_without_a_gpu_the_suite_builds_kernels_for_the_interpreter() -> None:
    # Guards the suite setup: forcing kernels on CPU is only meaningful if they interpret.
    assert torch.cuda.is_available() or dispatch.kernels_interpreted()


def test_cuda_always_selects_the_kernel(kernel_switch: Callable[[str, str | None], None]) -> None:
    kernel_switch(dispatch.FORCE_TRITON_ENV, None)
    assert dispatch.use_triton(torch.device("cuda", 0))
    assert not dispatch.use_triton(CPU)


def test_forcing_compiled_kernels_onto_cpu_says_how_to_fix_it(
    monkeypatch: pytest.MonkeyPatch, kernel_switch: Callable[[str, str | None], None]
) -> None:
    kernel_switch(dispatch.FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(dispatch, "kernels_interpreted", lambda: False)
    with pytest.raises(dispatch.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(CPU)
