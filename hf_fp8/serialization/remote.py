"""A Hub repo's config and tensor headers, without downloading its weights (``hf-fp8 inspect
org/name``): ``HfApi.get_safetensors_metadata`` reads the safetensors headers with range
requests; offline (``HF_HUB_OFFLINE=1``) the local Hub cache is read instead."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_fp8.serialization.checkpoint import (
    CONFIG_NAME,
    Checkpoint,
    TensorInfo,
    check_config_types,
)
from hf_fp8.utils.folders import check_shard_keys


@dataclass
class HubHeaders:
    """What ``summarize`` reads of a checkpoint, for a Hub repo: config and tensor headers."""

    root: str  # the repo id
    config: dict[str, Any]
    headers: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self.headers)


def _not_found(repo_id: str, err: Exception) -> FileNotFoundError:
    return FileNotFoundError(
        f"cannot read {repo_id!r} from the Hub or its local cache ({type(err).__name__}): "
        "check the repo id, log in (hf auth login), or pass a local folder"
    )


def hub_headers(
    repo_id: str, *, revision: str | None = None, token: str | bool | None = None
) -> HubHeaders:
    """Config and tensor headers of the Hub repo ``repo_id`` (no weights are downloaded)."""
    import huggingface_hub
    from huggingface_hub import constants, hf_hub_download

    try:
        config_file = hf_hub_download(repo_id, CONFIG_NAME, revision=revision, token=token)
    except Exception as err:  # offline cache miss, unknown repo, no access, no network
        raise _not_found(repo_id, err) from err
    config = json.loads(Path(config_file).read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(
            f"{repo_id}'s {CONFIG_NAME} holds a {type(config).__name__}, not a JSON object: "
            "not a model config"
        )
    check_config_types(config, f"{repo_id}'s {CONFIG_NAME}")
    if constants.HF_HUB_OFFLINE:  # the cached snapshot, read like a local folder
        try:
            headers = Checkpoint(Path(config_file).parent).tensors()
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"the weights of {repo_id!r} are not in the local Hub cache and HF_HUB_OFFLINE=1: "
                "go online (unset HF_HUB_OFFLINE) to read their headers from the Hub"
            ) from err
        return HubHeaders(repo_id, config, headers)
    try:
        meta = huggingface_hub.HfApi(token=token).get_safetensors_metadata(
            repo_id, revision=revision, token=token
        )
    except Exception as err:
        raise _not_found(repo_id, err) from err
    # a tensor in two shards, or in one the index does not name: refused (last copy would win)
    check_shard_keys(
        {file: list(file_meta.tensors) for file, file_meta in meta.files_metadata.items()},
        getattr(meta, "weight_map", None),  # huggingface_hub's metadata holds it; else dups only
        where=repo_id,
    )
    headers = {
        name: TensorInfo(info.dtype, tuple(info.shape), file)
        for file, file_meta in meta.files_metadata.items()
        for name, info in file_meta.tensors.items()
    }
    return HubHeaders(repo_id, config, headers)
