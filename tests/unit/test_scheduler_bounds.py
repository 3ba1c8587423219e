"""The per-worker bound on the waiting queue (`max_num_waiting`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.request import Request
from engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from engine.worker_config import WorkerConfig, WorkerConfigError
from kvcache.factory import create_manager
from kvcache.spec import CacheSpec

SPEC = CacheSpec(num_kv_heads=1, head_dim=4, attention_layers=(0,))
BLOCK = 4


class Params:
    max_tokens = 4


def _scheduler(max_num_waiting: int | None) -> Scheduler:
    manager = create_manager("v1", SPEC, 64, BLOCK, 0)
    config = SchedulerConfig(
        max_num_tokens=64,
        max_batch_size=2,
        max_model_tokens=manager.num_usable_blocks * BLOCK,
        max_num_waiting=max_num_waiting,
    )
    return Scheduler(config, manager)


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3, 4, 5], Params())


def test_a_full_waiting_queue_refuses_the_next_request_until_it_drains() -> None:
    sched = _scheduler(max_num_waiting=3)
    for i in range(3):
        sched.add(_request(f"r{i}"))
    with pytest.raises(QueueFullError, match="max_num_waiting"):
        sched.add(_request("r3"))
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2"]
    out = sched.schedule()  # two move to running (max_batch_size), freeing queue room
    sched.commit(out)
    assert len(sched.waiting) == 1
    sched.add(_request("r3"))
    sched.add(_request("r4"))
    with pytest.raises(QueueFullError):
        sched.add(_request("r5"))


def test_no_bound_by_default_and_worker_config_requires_a_positive_one() -> None:
    sched = _scheduler(max_num_waiting=None)
    for i in range(50):
        sched.add(_request(f"r{i}"))
    assert len(sched.waiting) == 50
    assert WorkerConfig(checkpoint="unused").max_num_waiting > 0
    with pytest.raises(WorkerConfigError, match="max_num_waiting"):
        WorkerConfig(checkpoint="unused", max_num_waiting=0)


def test_each_worker_may_queue_as_many_requests_as_the_cluster_admits(tmp_path: Path) -> None:
    from cluster.config.plan import resolve_plan
    from cluster.config.schema import config_from_dict
    from models.embedded.configs import checkpoint_config

    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config("llama", "tiny")))
    raw = {"model": str(tmp_path), "router": {"max_queued_requests": 7}}
    plan = resolve_plan(config_from_dict(raw | {"cache_transceiver": {"backend": "python"}}))
    configs = [i.worker_config("ckpt", "secret", "127.0.0.1") for i in plan.instances]
    assert [c.max_num_waiting for c in configs] == [7, 7]
