"""A checkpoint folder on disk: ``config.json``, safetensors shards, their index, other files.

Reads tensor headers without loading data, rewrites shards one at a time (memory stays at one
shard), and never writes outside the folder it was asked to write.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CARD_NAME = "README.md"

# safetensors dtype names → bytes per element
_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FP8_DTYPE_NAMES = ("F8_E4M3", "F8_E5M2")
# Weights in other formats (the unquantized model's) are never copied into a conversion.
_OTHER_WEIGHTS = {
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".onnx_data",
    ".gguf",
    ".safetensors",
}
_OTHER_WEIGHT_DIRS = {"onnx", "openvino"}


@dataclass(frozen=True)
class TensorInfo:
    """Header of one stored tensor: safetensors dtype name (``"F8_E4M3"``), shape, file."""

    dtype: str
    shape: tuple[int, ...]
    file: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPE_BYTES.get(self.dtype, 4)


def resolve_checkpoint(
    model_id: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> Path:
    """Local folder of ``model_id``: a directory as is, a Hub repo id through the Hub cache
    (``snapshot_download``, offline when ``HF_HUB_OFFLINE=1``)."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file: pass the checkpoint folder (the one with config.json)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(model_id))
    except HFValidationError:
        raise FileNotFoundError(
            f"{model_id!r} is neither a local folder nor a Hub repo id ('org/name')"
        ) from None
    try:
        return Path(
            snapshot_download(str(model_id), revision=revision, cache_dir=cache_dir, token=token)
        )
    except Exception as err:  # offline cache miss, unknown repo, no access
        raise FileNotFoundError(
            f"cannot get {model_id!r} from the Hub or its local cache ({type(err).__name__}): "
            "check the repo id, log in (hf auth login), or pass a local folder"
        ) from err


class Checkpoint:
    """A saved model folder: its config and the safetensors files that hold its tensors."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        config_path = self.root / CONFIG_NAME
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{self.root} has no {CONFIG_NAME}: pass a folder written by save_pretrained"
            )
        self.config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        index_path = self.root / INDEX_NAME
        if index_path.is_file():
            index = json.loads(index_path.read_text(encoding="utf-8"))
            self.weight_map: dict[str, str] = dict(index["weight_map"])
        elif (self.root / WEIGHTS_NAME).is_file():
            self.weight_map = {}
            with safe_open(self.root / WEIGHTS_NAME, "pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), WEIGHTS_NAME)
        else:
            raise FileNotFoundError(
                f"{self.root} has neither {WEIGHTS_NAME} nor {INDEX_NAME}: hf_fp8 reads "
                "safetensors checkpoints (save with safe_serialization, the default)"
            )

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    @property
    def quant_method(self) -> str | None:
        qc = self.quantization_config
        return None if qc is None else qc.get("quant_method")

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def tensors(self) -> dict[str, TensorInfo]:
        """Header of every tensor (no tensor data is read)."""
        infos: dict[str, TensorInfo] = {}
        for file in self.files:
            with safe_open(self.root / file, "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    s = f.get_slice(name)
                    infos[name] = TensorInfo(s.get_dtype(), tuple(s.get_shape()), file)
        return infos

    def load_file(self, file: str) -> dict[str, torch.Tensor]:
        with safe_open(self.root / file, "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118

    def iter_files(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        for file in self.files:
            yield file, self.load_file(file)

    def other_files(self) -> list[Path]:
        """Files besides config, weights, index and model card (tokenizer, generation config,
        sentence-transformers folders), relative to ``root``; hidden files and weights in
        other formats (``.bin``, ``onnx/`` …) are left out."""
        skip = {CONFIG_NAME, INDEX_NAME, CARD_NAME, *self.files}
        found = []
        for path in sorted(self.root.rglob("*")):
            rel = path.relative_to(self.root)
            if path.is_file() and str(rel) not in skip and not _hidden(rel) and not _weights(rel):
                found.append(rel)
        return found


def _weights(rel: Path) -> bool:
    return rel.suffix in _OTHER_WEIGHTS or bool(_OTHER_WEIGHT_DIRS & set(rel.parts[:-1]))


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def prepare_out_dir(
    out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None, overwrite: bool = False
) -> Path:
    """Create ``out_dir``; refuse the source folder itself and, unless ``overwrite``, a folder
    that already holds files (old shards would otherwise mix with new ones)."""
    out = Path(out_dir).expanduser()
    if source is not None and out.resolve() == Path(source).resolve():
        raise ValueError(f"the output folder {out} is the source folder: choose a new folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: the output must be a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out} is not empty: choose a new folder or pass overwrite=True (--overwrite)"
            )
        for stale in [*out.glob("*.safetensors"), out / INDEX_NAME]:
            if stale.is_file():
                stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def copy_other_files(src: Checkpoint, out_dir: Path) -> list[Path]:
    """Copy ``src.other_files()`` into ``out_dir``; returns the copied relative paths."""
    copied = src.other_files()
    for rel in copied:
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.root / rel, out_dir / rel)
    return copied


TensorMap = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def rewrite_tensors(src: Checkpoint, out_dir: Path, convert: TensorMap) -> dict[str, str]:
    """Write every shard of ``src`` through ``convert`` into ``out_dir`` under the same file
    names (``out_dir`` may be ``src.root``: each shard is read fully before it is rewritten);
    writes the index when there are several shards. Returns the new weight map."""
    weight_map: dict[str, str] = {}
    total = 0
    for file, tensors in src.iter_files():
        converted = {k: v.contiguous() for k, v in convert(tensors).items()}
        partial = out_dir / f".{file}.partial"  # then renamed: safe when rewriting in place
        save_file(converted, str(partial), metadata={"format": "pt"})
        os.replace(partial, out_dir / file)
        weight_map.update(dict.fromkeys(converted, file))
        total += sum(t.numel() * t.element_size() for t in converted.values())
    if len(src.files) > 1 or (src.root / INDEX_NAME).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return weight_map


def write_config(out_dir: Path, config: dict[str, Any]) -> None:
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (out_dir / CONFIG_NAME).write_text(text, encoding="utf-8")


def module_of(tensor_name: str) -> tuple[str, str]:
    """``"a.b.weight_scale"`` → ``("a.b", "weight_scale")``."""
    module, _, leaf = tensor_name.rpartition(".")
    return module, leaf
