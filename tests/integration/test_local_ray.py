"""`disagg serve` without `address` runs a Ray of its own, whatever `ray start`
left on the machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.ray_nodes import RayCluster, new_cluster, remove_cluster_files, start_node
from tests.serve_process import ROOT, start_serve, stop_group

CONFIG = ROOT / "deploy" / "configs" / "1p1d.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.embedded.writer import ensure_checkpoint

    return ensure_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", "tiny")


@pytest.fixture
def foreign_ray() -> Iterator[RayCluster]:
    cluster = new_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        remove_cluster_files(cluster)


def test_serve_starts_its_own_ray_despite_a_stopped_ray_start(
    foreign_ray: RayCluster, checkpoint: Path
) -> None:
    # `ray start --head`, then stopped (killed, not `ray stop`ped): its record
    # stays where Ray looks for a cluster to join. Serve must start a Ray of
    # its own, neither joining nor failing on the record.
    start_node(foreign_ray, "127.0.0.2", num_cpus=1, resources={"foreign": 1})
    foreign_ray.stop()
    record = foreign_ray.temp_dir / "ray" / "ray_current_cluster"
    assert record.exists(), "ray start left no record where serve looks"
    server = start_serve(CONFIG, checkpoint, env=foreign_ray.env)
    try:
        reply = httpx.post(
            server.url + "/completions",
            json={"model": checkpoint.name, "prompt": "Hello", "max_tokens": 2},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
    finally:
        stop_group(server.process)
