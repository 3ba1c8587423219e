"""Bring the checkpoint to every node that runs an instance.

    serving node (where `disagg serve` runs)   instance's node (its worker,
                                               as it starts or restarts there)
    manifest: size + sha256 of every file  ->  the configured path matches it? load it
    CheckpointServer actor                     else this node's cached copy? load it
      reads chunks of the files          --->  else stream every file in chunks
                                               through Ray's object store, check
                                               size and sha256, keep it in the
                                               node's cache, load it

An instance on the serving node loads the configured checkpoint as it is.
The node's cache is `$DISAGG_CHECKPOINT_CACHE`, else
`~/.cache/disagg/checkpoints`, one folder per content:

    <cache>/<manifest digest>/<folder or GGUF file name>

written under a temporary name and renamed when complete (`models.staging`),
and filled by one process at a time (a file lock), so instances that start
together on a node copy it once. A GGUF file travels as the file; the node
converts it into its own GGUF cache (`models.gguf.cache`). Progress goes to
the worker's log, which Ray forwards to `serve`'s output.

The launcher's side (`cluster.launch.checkpoint_shipping`) starts the server and
hands each instance off the serving node a `CheckpointSource` in its
`WorkerConfig`; the worker resolves it with `node_checkpoint` where it
starts (`WorkerConfig.on_this_node`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from models.checkpoint_manifest import CheckpointManifest, ManifestFile, matches
from models.checkpoint_source import checkpoint_folder
from models.staging import remove_abandoned, staging_path

logger = logging.getLogger(__name__)

CACHE_ENV = "DISAGG_CHECKPOINT_CACHE"
CHUNK_BYTES = 32 << 20
# Chunks requested ahead of the one being written: keeps the link busy while
# holding at most this many chunks in the node's object store.
CHUNKS_IN_FLIGHT = 4
_PROGRESS_EVERY_S = 5.0
_MIB = 1 << 20


class CheckpointCopyError(RuntimeError):
    """A copied file differs from the serving node's (size or sha256)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "disagg" / "checkpoints")


class CheckpointServer:
    """Reads the model source's files on the serving node, a chunk per call;
    only the files its manifest lists."""

    def __init__(self, source: str, manifest: CheckpointManifest) -> None:
        self._root = manifest.root(Path(source))
        self._names = {f.name for f in manifest.files}

    def read(self, name: str, offset: int, length: int) -> bytes:
        if name not in self._names:
            raise ValueError(f"{name!r} is not a file of the checkpoint")
        with (self._root / name).open("rb") as file:
            file.seek(offset)
            return file.read(length)


@dataclass(frozen=True)
class CheckpointSource:
    """Where a worker off the serving node gets its checkpoint from (carried
    by its `WorkerConfig`, so a restart on another node finds it too)."""

    path: str  # the model source as the serving node names it (absolute)
    manifest: CheckpointManifest
    # The CheckpointServer actor's name. A handle inside a worker's
    # constructor arguments would put them in Ray's object store, where they
    # can be lost before a restart needs them (ray-project/ray#53727).
    server: str


def node_checkpoint(source: CheckpointSource, instance: str) -> str:
    """On an instance's node: the checkpoint folder to load (see the module doc)."""
    _log_to_stderr()
    configured = Path(source.path)
    if matches(source.manifest, configured):
        logger.info("%s: %s on this node matches the serving node's", instance, configured)
        local = configured
    else:
        local = _cached_copy(source, instance)
    return str(checkpoint_folder(local, progress=False))


def _cached_copy(source: CheckpointSource, instance: str) -> Path:
    manifest = source.manifest
    entry = cache_dir() / manifest.digest
    local = entry / manifest.name
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _locked(entry.with_name(f"{entry.name}.lock")):
        if local.exists():
            logger.info("%s: using this node's copy of %s at %s", instance, manifest.name, local)
            return local
        remove_abandoned(entry)
        staging = staging_path(entry)
        try:
            _copy(source, staging / manifest.name, instance)
            staging.rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return local


def _copy(source: CheckpointSource, target: Path, instance: str) -> None:
    manifest = source.manifest
    root = manifest.root(target)
    root.mkdir(parents=True)
    count = len(manifest.files)
    logger.info(
        "%s: copying %s (%.1f MiB in %d file%s) from the serving node into %s",
        instance,
        manifest.name,
        manifest.num_bytes / _MIB,
        count,
        "" if count == 1 else "s",
        target,
    )
    progress = _Progress(instance, manifest.num_bytes)
    server = ray.get_actor(source.server)
    for file in manifest.files:
        _copy_file(server, file, root / file.name, progress)
    logger.info(
        "%s: copied %s, every file's size and sha256 checked, in %.1f s",
        instance,
        manifest.name,
        time.monotonic() - progress.started,
    )


def _copy_file(server: Any, file: ManifestFile, path: Path, progress: _Progress) -> None:
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for chunk in _chunks(server, file):
            out.write(chunk)
            digest.update(chunk)
            progress.advance(len(chunk))
    size = path.stat().st_size
    if size != file.size or digest.hexdigest() != file.sha256:
        raise CheckpointCopyError(
            f"the copy of {file.name} on this node ({size} bytes, sha256 "
            f"{digest.hexdigest()}) differs from the serving node's ({file.size} bytes, "
            f"sha256 {file.sha256}); was the checkpoint changed while serve started?"
        )


def _chunks(server: Any, file: ManifestFile) -> Iterator[bytes]:
    """The file's bytes in order, with a few chunks requested ahead."""
    offsets = iter(range(0, file.size, CHUNK_BYTES))
    pending: deque[Any] = deque()
    while True:
        while len(pending) < CHUNKS_IN_FLIGHT and (offset := next(offsets, None)) is not None:
            pending.append(server.read.remote(file.name, offset, CHUNK_BYTES))
        if not pending:
            return
        yield ray.get(pending.popleft())


class _Progress:
    """Logs how much was copied, at most every few seconds."""

    def __init__(self, instance: str, total: int) -> None:
        self.instance = instance
        self.total = total
        self.done = 0
        self.started = self._logged = time.monotonic()

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        now = time.monotonic()
        if now - self._logged >= _PROGRESS_EVERY_S:
            self._logged = now
            logger.info(
                "%s: copied %.0f%% (%.1f of %.1f MiB)",
                self.instance,
                100 * self.done / self.total,
                self.done / _MIB,
                self.total / _MIB,
            )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _log_to_stderr() -> None:
    """Progress reaches `serve`'s output through the worker's stderr, whatever the
    worker process's logging setup."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
