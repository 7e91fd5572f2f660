"""A local stand-in for the Hub API and a Hub cache laid out on disk as huggingface_hub does.

``FakeHubApi`` replaces ``transformers.utils.hub.hf_api()``: it records every call, keeps the
bytes of each commit (the uploader's temporary folder is gone when the test looks) and
publishes them into ``cache_dir`` with the real layout::

    models--org--name/blobs/<sha256>
    models--org--name/refs/<revision>                 (commit hash)
    models--org--name/snapshots/<commit>/<path>       (relative symlink to the blob)

so ``from_pretrained("org/name")`` with ``HF_HUB_OFFLINE=1`` resolves the uploaded files.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from huggingface_hub import CommitOperationAdd
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def snapshot_files(cache_dir: Path, repo_id: str, revision: str = "main") -> dict[str, bytes]:
    """Files of the current snapshot of ``repo_id`` in the cache (empty when none)."""
    repo = repo_folder(cache_dir, repo_id)
    ref = repo / "refs" / revision
    if not ref.is_file():
        return {}
    snap = repo / "snapshots" / ref.read_text()
    return {
        p.relative_to(snap).as_posix(): p.read_bytes()
        for p in sorted(snap.rglob("*"))
        if p.is_file()
    }


def write_snapshot(
    cache_dir: Path, repo_id: str, files: dict[str, bytes], revision: str = "main"
) -> str:
    """Lay ``files`` out as one snapshot of ``repo_id``; returns the commit hash."""
    repo = repo_folder(cache_dir, repo_id)
    digest = hashlib.sha1()
    for path in sorted(files):
        digest.update(path.encode() + hashlib.sha256(files[path]).digest())
    commit = digest.hexdigest()
    for path, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = repo / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def cache_folder(cache_dir: Path, repo_id: str, folder: Path) -> str:
    """Put every file of a local ``folder`` into the cache as ``repo_id``; returns the commit."""
    files = {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }
    return write_snapshot(cache_dir, repo_id, files)


@dataclass
class Commit:
    repo_id: str
    revision: str
    message: str
    files: dict[str, bytes]
    create_pr: bool = False


@dataclass
class FakeHubApi:
    """Records calls; each commit is kept and published into ``cache_dir``."""

    cache_dir: Path
    calls: list[tuple[str, str]] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)

    def create_repo(self, repo_id: str, *, exist_ok: bool = False, **kwargs) -> SimpleNamespace:
        self.calls.append(("create_repo", repo_id))
        return SimpleNamespace(repo_id=repo_id, url=f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id: str, *, branch: str, **kwargs) -> None:
        self.calls.append(("create_branch", f"{repo_id}@{branch}"))

    def create_commit(
        self, repo_id: str, operations, *, commit_message: str, revision=None, create_pr=False, **kw
    ) -> SimpleNamespace:
        self.calls.append(("create_commit", repo_id))
        files = {}
        for op in operations:
            assert isinstance(op, CommitOperationAdd), f"unexpected operation {op!r}"
            with op.as_file() as f:
                files[op.path_in_repo] = f.read()
        revision = revision or "main"
        self.commits.append(Commit(repo_id, revision, commit_message, files, create_pr))
        merged = {**snapshot_files(self.cache_dir, repo_id, revision), **files}
        oid = write_snapshot(self.cache_dir, repo_id, merged, revision)
        return SimpleNamespace(oid=oid, commit_url=f"https://huggingface.co/{repo_id}/commit/{oid}")

    def upload_folder(
        self,
        *,
        repo_id: str,
        folder_path,
        allow_patterns=None,
        ignore_patterns=None,
        commit_message: str | None = None,
        revision=None,
        create_pr=False,
        **kwargs,
    ) -> SimpleNamespace:
        """As ``HfApi.upload_folder``: files (symlinks followed), filtered with the same
        patterns and default ignores, uploaded in one commit."""
        self.calls.append(("upload_folder", repo_id))
        root = Path(folder_path)
        relpaths = [
            p.relative_to(root).as_posix() for p in sorted(root.glob("**/*")) if p.is_file()
        ]
        ignore = (
            [ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or [])
        )
        kept = filter_repo_objects(
            relpaths,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore + DEFAULT_IGNORE_PATTERNS,
        )
        operations = [
            CommitOperationAdd(path_in_repo=rel, path_or_fileobj=(root / rel).read_bytes())
            for rel in kept
        ]
        return self.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload folder using huggingface_hub",
            revision=revision,
            create_pr=create_pr,
        )

    def __getattr__(self, name: str):
        raise AssertionError(f"unexpected Hub API call: {name}")


def block_network(monkeypatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if len(args) > 1 else args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
