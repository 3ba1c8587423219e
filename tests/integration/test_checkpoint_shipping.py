"""The checkpoint server's lifetime (`cluster.launch.checkpoint_shipping`): started
for the first instance off the serving node, kept while the cluster runs
(restarted instances may need it), stopped with the cluster. One local Ray
node; "another node" is a node id that no instance of the serving node has.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.config.plan import resolve_plan
from cluster.config.schema import config_from_dict
from cluster.launch.checkpoint_shipping import CheckpointShipping
from cluster.launch.launcher import RunningCluster, init_local_ray
from models.checkpoint_manifest import manifest_of
from models.embedded.writer import write_checkpoint

SERVER = "checkpoint-server-under-test"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    init_local_ray(1, log_to_driver=False)
    yield
    ray.shutdown()


def _gone(name: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


async def test_the_server_serves_instances_off_the_serving_node_until_the_cluster_stops(
    ray_session: None, tmp_path: Path
) -> None:
    checkpoint = write_checkpoint(tmp_path / "llama", "llama", "tiny")
    plan = resolve_plan(config_from_dict({"model": str(checkpoint)}))
    shipping = CheckpointShipping(plan.model_source, SERVER)
    cluster = RunningCluster(plan, shipping=shipping)

    assert await shipping.source_for(shipping.serving_node) is None
    assert shipping.server is None  # nothing to serve yet
    source = await shipping.source_for("f" * 56)
    assert source is not None and source.server == SERVER
    assert source.manifest == manifest_of(checkpoint)
    assert await shipping.source_for("e" * 56) is source  # one server for every node
    config = (checkpoint / "config.json").read_bytes()
    assert ray.get(ray.get_actor(SERVER).read.remote("config.json", 0, 64)) == config[:64]

    await cluster.shutdown()
    assert _gone(SERVER)
