"""Upload a checkpoint folder to the Hub with its model card (``hf-fp8 push``).

Every Hub call goes through ``transformers.utils.hub.hf_api()``, as ``push_to_hub`` does, and
only when the user asks for an upload; the files go up through ``HfApi.upload_folder``. The
folder itself is never modified, and nothing outside it is uploaded: symlinks are refused.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from transformers.utils import hub as hf_hub

from hf_fp8.hub.card import merge_card
from hf_fp8.hub.card_file import read_card
from hf_fp8.hub.card_info import info_from_summary
from hf_fp8.serialization.checkpoint import CARD_NAME, Checkpoint
from hf_fp8.serialization.summary import summarize
from hf_fp8.utils.folders import folder_files as utils_folder_files


def card_for_folder(
    folder: str | os.PathLike,
    repo_id: str | None = None,
    *,
    base_model: str | None = None,
    fidelity: dict[str, Any] | None = None,
) -> str:
    """The model card ``folder`` gets on the Hub: its README.md re-rendered (when hf_fp8 wrote
    it) or kept (when a person did, hf_fp8's metadata added), or a fresh one."""
    checkpoint = Checkpoint(folder)
    overrides: dict[str, Any] = {"repo_id": repo_id}
    if base_model:
        overrides["base_model"] = base_model
    if fidelity:
        overrides["fidelity"] = dict(fidelity)
    info = info_from_summary(summarize(checkpoint), **overrides)
    # never followed: a README.md linked out of the folder (or a FIFO, a folder, an oversized
    # file) raises UnsafePathError before anything is uploaded (hf_fp8.hub.card_file)
    return merge_card(read_card(checkpoint.root), info)


def folder_files(folder: str | os.PathLike) -> list[str]:
    """Relative paths of the files ``push_folder`` uploads: those of
    :func:`hf_fp8.utils.folders.folder_files` (hidden files left out, a symlink other than a Hub
    cache snapshot's raises ``UnsafePathError``) except ``README.md``: the card is uploaded from
    memory, rendered from the folder's README.md as :func:`card_for_folder` reads it (a link
    refused there)."""
    return utils_folder_files(folder, keep=lambda rel: rel != CARD_NAME)


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    base_model: str | None = None,
    fidelity: dict[str, Any] | None = None,
    allow_patterns: list[str] | str | None = None,
    ignore_patterns: list[str] | str | None = None,
) -> Any:
    """Create ``repo_id`` if needed and upload ``folder`` with its model card in one commit,
    through ``HfApi.upload_folder`` (``allow_patterns`` / ``ignore_patterns`` as there);
    returns the Hub's ``CommitInfo``.

    Hidden files are left out and symlinks refused (:func:`folder_files`; README.md included:
    :func:`card_for_folder`), before any Hub call. The folder itself is
    never modified: the upload reads a temporary folder of links to the checked files plus the
    rendered ``README.md``.
    """
    folder = Path(folder)
    files = folder_files(folder)
    card = card_for_folder(folder, repo_id, base_model=base_model, fidelity=fidelity)
    api = hf_hub.hf_api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_fp8-push-") as stage:
        for rel in files:
            link = Path(stage, rel)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink((folder / rel).resolve(), link)
        Path(stage, CARD_NAME).write_text(card, encoding="utf-8")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=stage,
            commit_message=commit_message or "Upload FP8 model (hf-fp8)",
            token=token,
            revision=revision,
            create_pr=create_pr,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
        )
