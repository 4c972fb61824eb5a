"""A Hugging Face Hub cache laid out by hand, as huggingface_hub lays out its downloads (blobs,
relative symlinks under ``snapshots/<commit>``, ``refs/<branch>``, the tree listing of the
commit), for tests that resolve Hub ids offline."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
from huggingface_hub.file_download import repo_folder_name

# Stored in Git LFS on the Hub (the rest are plain git blobs): named by sha256 in the cache.
_LFS_SUFFIXES = (".safetensors", ".parquet")


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubCache:
    """An ``HF_HUB_CACHE`` that repositories are laid into, as if downloaded."""

    root: Path

    def add(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        repo_type: str = "model",
        refs: tuple[str, ...] = ("main",),
        not_downloaded: dict[str, bytes] | None = None,
    ) -> str:
        """One commit of ``repo_id`` holding ``files`` and ``not_downloaded`` (listed in the
        commit's tree, absent from the snapshot); ``refs`` point at it. Returns the commit."""
        storage = self.root / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        everything = {**files, **(not_downloaded or {})}
        commit = hashlib.sha1(repr(sorted(everything.items())).encode()).hexdigest()
        tree = {}
        for path, data in everything.items():
            lfs = path.endswith(_LFS_SUFFIXES)
            sha256 = hashlib.sha256(data).hexdigest()
            tree[path] = TreeCacheEntry(
                size=len(data),
                blob_id=_git_blob_id(data),
                lfs_sha256=sha256 if lfs else None,
                lfs_size=len(data) if lfs else None,
            )
            if path in files:
                blob = storage / "blobs" / (sha256 if lfs else _git_blob_id(data))
                blob.parent.mkdir(parents=True, exist_ok=True)
                blob.write_bytes(data)
                link = storage / "snapshots" / commit / path
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(blob, link.parent))
        write_tree_cache(str(storage), commit, tree)
        for ref in refs:
            (storage / "refs").mkdir(parents=True, exist_ok=True)
            (storage / "refs" / ref).write_text(commit)
        return commit

    def snapshot(self, repo_id: str, commit: str, repo_type: str = "model") -> Path:
        return (
            self.root
            / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
            / "snapshots"
            / commit
        )


def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    """An empty cache in ``HF_HUB_CACHE``, offline: nothing is ever downloaded."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative paths that look like ids exist nowhere
    return HubCache(tmp_path / "hub")


def parquet_bytes(table: pa.Table) -> bytes:
    """A parquet file's bytes, as a dataset repository stores it."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()
