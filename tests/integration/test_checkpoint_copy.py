"""A worker resolves its checkpoint where it starts, Ray restarts included
(`WorkerConfig.on_this_node`, `engine.checkpoint_copy`).

One local Ray node plays both sides. The `CheckpointServer` reads the
serving node's files from one folder; the worker's configured path is
another folder with the same files, standing for the copy its node has.
The worker first loads that folder. Then the folder is removed (the node a
restarted instance lands on has no files there) and the actor is killed
with a restart allowed: the restarted worker must copy the checkpoint from
the server into its node's cache and serve transformers' greedy tokens
again.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from decode_worker.worker import GenerationWorker
from engine.checkpoint_copy import CACHE_ENV, CheckpointServer, CheckpointSource
from engine.messages import GenerationRequest
from engine.sampling import SamplingParams
from engine.worker_config import WorkerConfig
from models.checkpoint_manifest import manifest_of
from models.embedded.writer import write_checkpoint
from tests.launched_cluster import transformers_greedy

PROMPT = [5, 17, 42, 99, 7, 300, 12]
NEW_TOKENS = 8
RESTART_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _greedy(worker: Any, request_id: str) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    stream = worker.generate.remote(GenerationRequest(request_id, PROMPT, params))
    return [t for ref in stream for t in ray.get(ref).token_ids]


def _pid(worker: Any) -> int:
    return int(ray.get(worker.__ray_call__.remote(lambda _: os.getpid())))


def _restarted(worker: Any, old_pid: int) -> None:
    """Wait until the actor runs in a new process (its constructor has run
    again) and starts."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        assert time.monotonic() < deadline, "the worker did not come back"
        try:
            if _pid(worker) != old_pid:
                ray.get(worker.start.remote())
                return
        except RayActorError:  # down, or its restart is under way
            pass
        time.sleep(1)


def test_a_restarted_worker_without_its_files_copies_the_checkpoint_and_serves_again(
    ray_session: None, tmp_path: Path
) -> None:
    serving = write_checkpoint(tmp_path / "serving" / "llama", "llama", "tiny", seed=3)
    configured = tmp_path / "node" / "llama"
    shutil.copytree(serving, configured)
    manifest = manifest_of(serving)
    server = (
        ray.remote(CheckpointServer)
        .options(num_cpus=0, name="checkpoint-server")
        .remote(str(serving), manifest)
    )
    source = CheckpointSource(str(configured), manifest, "checkpoint-server")
    config = WorkerConfig(
        checkpoint=str(configured),
        checkpoint_source=source,
        max_tokens=256,
        max_num_tokens=64,
        max_batch_size=4,
    )
    cache = tmp_path / "node-cache"
    worker = (
        ray.remote(GenerationWorker)
        .options(
            num_cpus=1,
            max_restarts=1,
            runtime_env={"env_vars": {CACHE_ENV: str(cache)}},
        )
        .remote(config, "generation-0", "aggregated")
    )
    try:
        expected = transformers_greedy(serving, [PROMPT], NEW_TOKENS)[0]
        ray.get(worker.start.remote())
        assert _greedy(worker, "before") == expected
        assert not cache.exists()  # the configured folder matched: nothing copied

        shutil.rmtree(configured)
        first = _pid(worker)
        ray.kill(worker, no_restart=False)
        _restarted(worker, first)

        assert _greedy(worker, "after") == expected
        copy = cache / manifest.digest / "llama"
        assert manifest_of(copy) == manifest
    finally:
        ray.kill(worker, no_restart=True)
        ray.kill(server)
