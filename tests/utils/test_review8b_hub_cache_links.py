"""A Hub cache snapshot may link into its repo's ``blobs/``, and only there (reviewer R7 1).

Before: ``hub_cache_root`` resolved ``blobs``, so a ``blobs`` that is itself a symlink (to
``~/private``) made every file there "the cache's own": ``push`` uploaded a snapshot link
``notes.txt -> ../../blobs/id_rsa``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_fp8.utils.folders import (
    UnsafePathError,
    check_loaded_files,
    check_source_folder,
    contained,
    folder_files,
    hub_cache_root,
)


def _private(tmp_path: Path) -> Path:
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_text("SECRET KEY\n")
    return private


def _snapshot(repo: Path, blobs_link_to: Path | None = None) -> Path:
    """``repo/snapshots/main`` with ``config.json`` and ``notes.txt -> ../../blobs/id_rsa``;
    ``blobs`` a link to ``blobs_link_to`` or a real folder holding a real ``id_rsa``."""
    snap = repo / "snapshots" / "main"
    snap.mkdir(parents=True)
    if blobs_link_to is not None:
        os.symlink(blobs_link_to, repo / "blobs")
    else:
        (repo / "blobs").mkdir()
        (repo / "blobs" / "id_rsa").write_text("a blob\n")
    (snap / "config.json").write_text("{}")
    os.symlink("../../blobs/id_rsa", snap / "notes.txt")
    return snap


def test_blobs_that_is_a_symlink_is_refused(tmp_path):
    snap = _snapshot(tmp_path / "models--acme--tiny", blobs_link_to=_private(tmp_path))
    for check in (hub_cache_root, folder_files, check_source_folder):
        with pytest.raises(UnsafePathError, match=r"blobs is a symlink"):
            check(snap)
    with pytest.raises(UnsafePathError, match=r"blobs is a symlink"):
        check_loaded_files(snap, [os.path.join(snap, "notes.txt")])
    # the allowed root itself is never taken through a link
    with pytest.raises(UnsafePathError, match="symlink"):
        contained(snap, "notes.txt", links_within=snap.parent.parent / "blobs")


def test_real_cache_layout_still_allowed(tmp_path):
    repo = tmp_path / "models--acme--tiny"
    snap = _snapshot(repo)
    assert hub_cache_root(snap) == (repo / "blobs").resolve()
    assert folder_files(snap) == ["config.json", "notes.txt"]
    # a link to a real snapshot (the user's own shortcut) reads the cache it points to
    shortcut = tmp_path / "my-model"
    shortcut.symlink_to(snap)
    assert hub_cache_root(shortcut) == (repo / "blobs").resolve()
    assert folder_files(shortcut) == ["config.json", "notes.txt"]


def test_blob_that_is_a_symlink_is_refused(tmp_path):
    snap = _snapshot(tmp_path / "models--acme--tiny")
    blob = snap.parent.parent / "blobs" / "id_rsa"
    blob.unlink()
    blob.symlink_to(_private(tmp_path) / "id_rsa")
    with pytest.raises(UnsafePathError, match=r"notes\.txt is a symlink"):
        folder_files(snap)


@pytest.mark.parametrize("linked", ["repo", "snapshots", "snapshot"])
def test_cache_folders_reached_through_a_link_are_refused(tmp_path, linked):
    """The repo folder, ``snapshots/`` or the snapshot spelled in a cache layout but being a
    link: a real cache never has one (a link of the snapshot to ``~/private`` would make that
    folder's files "the snapshot's")."""
    real = _snapshot(tmp_path / "elsewhere" / "models--acme--tiny")
    repo = tmp_path / "received" / "models--acme--tiny"
    repo.parent.mkdir()
    if linked == "repo":
        repo.symlink_to(real.parent.parent)
    else:
        (repo / "blobs").mkdir(parents=True)
        if linked == "snapshots":
            (repo / "snapshots").symlink_to(real.parent)
        else:
            (repo / "snapshots").mkdir()
            (repo / "snapshots" / "main").symlink_to(_private(tmp_path))
    spelled = repo / "snapshots" / "main"
    with pytest.raises(UnsafePathError, match=r"is a symlink.*Hub cache"):
        folder_files(spelled)
    with pytest.raises(UnsafePathError, match=r"is a symlink.*Hub cache"):
        check_source_folder(spelled)


def test_only_hub_repo_folders_are_caches(tmp_path):
    """``X/snapshots/S`` next to ``X/blobs`` is a cache only when ``X`` is named as the Hub
    names its repo folders (``models--org--name``, ``datasets--``, ``spaces--``)."""
    snap = _snapshot(tmp_path / "work")
    assert hub_cache_root(snap) is None
    with pytest.raises(UnsafePathError, match=r"notes\.txt is a symlink"):
        folder_files(snap)
    assert hub_cache_root(_snapshot(tmp_path / "models--gpt2")) is not None


def test_check_files_inside_refuses_dotdot_through_a_link(tmp_path):
    """``sub/../secret`` normalizes to ``secret`` inside the folder, but is opened through
    ``sub``, a link: it reads ``other/secret``."""
    from hf_fp8.utils.folders import check_files_inside

    (tmp_path / "other" / "d").mkdir(parents=True)
    (tmp_path / "other" / "secret").write_text("S")
    root = tmp_path / "model"
    root.mkdir()
    (root / "sub").symlink_to(tmp_path / "other" / "d")
    with pytest.raises(UnsafePathError, match="outside the folder"):
        check_files_inside(root, [os.path.join(root, "sub", "..", "secret")])
