"""The launcher's side of bringing the checkpoint to every node.

    instance placed on the serving node   WorkerConfig(checkpoint=<the folder>)
    instance placed on another node       WorkerConfig(checkpoint=<the folder>,
                                              checkpoint_source=<path, manifest,
                                              CheckpointServer actor's name>)

The worker resolves its checkpoint where it starts (`engine.checkpoint_copy.
worker_checkpoint`), so an instance that Ray restarts on another node, after
its node died, finds or copies the checkpoint there too. The server must
therefore outlive the launch: it is started with the first instance placed
off the serving node and runs until the cluster shuts down. An instance on
the serving node needs none: it can only leave that node when the node dies,
and `serve` dies with it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engine.checkpoint_copy import CheckpointServer, CheckpointSource
from models.checkpoint_manifest import manifest_of


class CheckpointShipping:
    """The `CheckpointSource` of each instance; computes the manifest and
    starts the server only when the first instance lands on another node."""

    def __init__(self, model_source: str, server_name: str) -> None:
        self.model_source = model_source
        self.server_name = server_name  # unique to the deployment on its Ray cluster
        self.serving_node = ray.get_runtime_context().get_node_id()
        self.server: Any = None  # the CheckpointServer actor, once started
        self._source: asyncio.Future[CheckpointSource] | None = None

    async def source_for(self, node_id: str) -> CheckpointSource | None:
        """What an instance placed on `node_id` gets its checkpoint from; None
        on the serving node."""
        if node_id == self.serving_node:
            return None
        if self._source is None:
            self._source = asyncio.ensure_future(self._start_server())
        return await asyncio.shield(self._source)

    def close(self) -> Any:
        """Start no server any more; the one started, for the caller to kill
        (None if none)."""
        if self._source is not None:
            self._source.cancel()  # a manifest still being computed starts none
        return self.server

    async def _start_server(self) -> CheckpointSource:
        path = Path(self.model_source)
        manifest = await asyncio.to_thread(manifest_of, path)
        self.server = (
            ray.remote(CheckpointServer)
            .options(
                num_cpus=0,
                name=self.server_name,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.serving_node, soft=False),
            )
            .remote(str(path), manifest)
        )
        return CheckpointSource(str(path), manifest, self.server_name)
