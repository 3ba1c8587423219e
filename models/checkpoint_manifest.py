"""The files that make a model source, each with its size and sha256.

A model source is what `model:` names once resolved (`checkpoint_source.
model_source`): a checkpoint folder, or one GGUF file. Its manifest lists

    folder     every non-hidden file directly inside it, less weight formats
               no loader here reads (*.bin, *.pt, *.pth, ... : a folder that
               also ships PyTorch or Flax weights, or Llama's `original/`,
               does not move them)
    GGUF file  the file alone

A node compares its own copy with the manifest before loading from it
(`matches`: sizes first, which is cheap, then sha256), and the manifest's
`digest` names a node's cached copy by content.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

# Weight formats next to the safetensors that nothing here loads.
UNREAD_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf"})
_HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class ManifestFile:
    name: str  # relative to the source folder (the file's own name for a GGUF file)
    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointManifest:
    name: str  # the folder's or the GGUF file's name
    is_file: bool  # a GGUF file rather than a folder
    files: tuple[ManifestFile, ...]

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """sha256 over every file's name, size and sha256: the content's address."""
        lines = (f"{f.name}\0{f.size}\0{f.sha256}\n" for f in self.files)
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    def root(self, source: Path) -> Path:
        """The folder the file names are relative to, for a copy at `source`."""
        return source.parent if self.is_file else source


def manifest_of(source: Path) -> CheckpointManifest:
    """The manifest of the folder or file `source` (hashes every file it lists)."""
    files = [source] if source.is_file() else sorted(filter(_is_listed, source.iterdir()))
    entries = tuple(ManifestFile(p.name, p.stat().st_size, file_sha256(p)) for p in files)
    return CheckpointManifest(source.name, source.is_file(), entries)


def matches(manifest: CheckpointManifest, source: Path) -> bool:
    """Whether `source` holds every file of `manifest` with the same size and sha256."""
    if source.is_file() != manifest.is_file or source.name != manifest.name:
        return False
    root = manifest.root(source)
    pairs = [(root / f.name, f) for f in manifest.files]
    if not all(path.is_file() and path.stat().st_size == f.size for path, f in pairs):
        return False
    return all(file_sha256(path) == f.sha256 for path, f in pairs)


_digests: dict[tuple[str, int, int, int], str] = {}
_digests_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """The file's sha256; remembered in this process while the file is unchanged
    (same size, modification time and inode), so one start hashes a file once."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    with _digests_lock:
        known = _digests.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    with _digests_lock:
        _digests[key] = digest.hexdigest()
    return _digests[key]


def _is_listed(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and path.suffix not in UNREAD_SUFFIXES
