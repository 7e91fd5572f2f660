"""Upload a checkpoint folder to the Hub with its model card (``hf-fp8 push``).

Every Hub call goes through ``transformers.utils.hub.hf_api()``, as ``push_to_hub`` does, and
only when the user asks for an upload. The folder itself is never modified: the card is
uploaded from memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd
from transformers.utils import hub as hf_hub

from hf_fp8.hub.card import merge_card
from hf_fp8.hub.card_info import info_from_summary
from hf_fp8.serialization.checkpoint import CARD_NAME, Checkpoint
from hf_fp8.serialization.summary import summarize


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
    readme = checkpoint.root / CARD_NAME
    existing = readme.read_text(encoding="utf-8") if readme.is_file() else None
    return merge_card(existing, info)


def _operations(folder: Path, card: str) -> list[CommitOperationAdd]:
    ops = [CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode("utf-8"))]
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if (
            path.is_file()
            and rel.as_posix() != CARD_NAME
            and not any(part.startswith(".") for part in rel.parts)
        ):
            ops.append(CommitOperationAdd(path_in_repo=rel.as_posix(), path_or_fileobj=str(path)))
    return ops


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
) -> Any:
    """Create ``repo_id`` if needed and upload every file of ``folder`` (hidden ones left out)
    plus its model card in one commit; returns the Hub's ``CommitInfo``."""
    folder = Path(folder)
    card = card_for_folder(folder, repo_id, base_model=base_model, fidelity=fidelity)
    api = hf_hub.hf_api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    return api.create_commit(
        repo_id=repo_id,
        operations=_operations(folder, card),
        commit_message=commit_message or "Upload FP8 model (hf-fp8)",
        token=token,
        revision=revision,
        create_pr=create_pr,
    )
