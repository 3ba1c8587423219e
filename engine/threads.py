"""Size torch's intra-op thread pool from the CPUs Ray granted the actor.

Several workers may share one machine; each must use only its own share of
cores or they oversubscribe and every step slows down.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)


def granted_cpus() -> float | None:
    """CPUs Ray assigned to the current actor or task; None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    try:
        resources = ray.get_runtime_context().get_assigned_resources()
    except AssertionError:  # the driver process: Ray granted it nothing
        return None
    cpus = resources.get("CPU")
    return float(cpus) if cpus else None


def configure_torch_threads(device: str) -> int:
    """On CPU set `torch.set_num_threads` to the Ray CPU grant (at least 1).

    Returns the thread count in effect. On GPU the grant only covers host-side
    work, so torch's default is left alone.
    """
    if device != "cpu":
        return torch.get_num_threads()
    cpus = granted_cpus()
    if cpus is None:
        return torch.get_num_threads()
    threads = max(1, math.floor(cpus))
    torch.set_num_threads(threads)
    logger.info("torch uses %d threads (Ray granted %.2f CPUs)", threads, cpus)
    return threads
