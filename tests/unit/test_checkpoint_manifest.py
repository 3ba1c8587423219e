"""The manifest a node checks its copy of a checkpoint against."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from models.checkpoint_manifest import file_sha256, manifest_of, matches


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text('{"a": 1}')
    (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (out / "pytorch_model.bin").write_bytes(b"weights nothing here reads")
    (out / ".gitattributes").write_text("*.safetensors lfs")
    (out / "original").mkdir()
    (out / "original" / "consolidated.00.pth").write_bytes(b"x")
    return out


def test_lists_the_files_a_loader_reads(folder: Path) -> None:
    manifest = manifest_of(folder)
    assert manifest.name == "model" and not manifest.is_file
    assert [f.name for f in manifest.files] == ["config.json", "model.safetensors"]
    assert manifest.num_bytes == len('{"a": 1}') + 256 * 64


def test_a_copy_elsewhere_matches_and_a_changed_one_does_not(folder: Path, tmp_path: Path) -> None:
    manifest = manifest_of(folder)
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(folder, copy)
    assert matches(manifest, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1  # same size, other bytes: only sha256 tells
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))
    assert not matches(manifest, copy)
    weights.write_bytes(b"short")
    assert not matches(manifest, copy)
    weights.unlink()
    assert not matches(manifest, copy)
    assert not matches(manifest, tmp_path / "missing" / "model")


def test_a_gguf_file_is_its_own_manifest(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    manifest = manifest_of(gguf)
    assert manifest.is_file and manifest.name == "tiny.gguf"
    assert [f.name for f in manifest.files] == ["tiny.gguf"]
    assert manifest.root(tmp_path / "copy" / "tiny.gguf") == tmp_path / "copy"
    assert not matches(manifest, tmp_path)  # a folder is not the file


def test_the_digest_follows_the_content(folder: Path) -> None:
    before = manifest_of(folder).digest
    assert manifest_of(folder).digest == before
    (folder / "config.json").write_text('{"a": 2}')
    assert manifest_of(folder).digest != before


def test_a_remembered_hash_is_dropped_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"one")
    first = file_sha256(path)
    path.write_bytes(b"two")
    os.utime(path, ns=(2, 2))  # a new modification time even within one clock tick
    assert file_sha256(path) != first
