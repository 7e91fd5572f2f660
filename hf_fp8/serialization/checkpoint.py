"""A checkpoint folder on disk: ``config.json``, safetensors shards, their index, other files.

Reads tensor headers without loading data, rewrites shards one at a time (memory stays at one
shard). Every path goes through ``atomic.contained`` (inside the folder, no symlinks) and every
output through ``atomic.atomic_folder`` (all or nothing, files it did not write are kept).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_fp8.serialization.atomic import atomic_folder, contained, hub_cache_root

# the folder checks live in hf_fp8.utils.folders (the quantizer runs them too); re-exported
from hf_fp8.utils.folders import (  # noqa: F401
    ShardKeyError,
    check_shard_keys,
    check_source_folder,
    folder_files,
    read_index,
)

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
# Folders holding the same model in other formats (Llama's ``original/consolidated.*.pth``).
_OTHER_WEIGHT_DIRS = {"onnx", "openvino", "original"}


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

    check_repo_id(str(model_id))
    try:
        return Path(
            snapshot_download(str(model_id), revision=revision, cache_dir=cache_dir, token=token)
        )
    except Exception as err:  # offline cache miss, unknown repo, no access
        raise FileNotFoundError(
            f"cannot get {model_id!r} from the Hub or its local cache ({type(err).__name__}): "
            "check the repo id, log in (hf auth login), or pass a local folder"
        ) from err


def check_repo_id(model_id: str) -> None:
    """Raise ``FileNotFoundError`` unless ``model_id`` can be a Hub repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise FileNotFoundError(
            f"{model_id!r} is neither a local folder nor a Hub repo id ('org/name')"
        ) from None


class OutputExistsError(FileExistsError):
    """The output folder holds files and overwriting was not asked for."""


def _open(path: Path):
    try:
        return safe_open(path, "pt")
    except Exception as err:  # SafetensorError is not an OSError / ValueError
        raise ValueError(
            f"{path.name} is not a readable safetensors file ({' '.join(str(err).split())}): "
            "the checkpoint is damaged or incomplete; download or save it again"
        ) from err


class Checkpoint:
    """A saved model folder: its config and the safetensors files that hold its tensors.

    Every file is reached through :func:`contained`: shard names from the index must lie in
    the folder, and symlinks are refused (except a Hub cache snapshot's links into its own
    ``blobs/``). Like transformers 5.24, ``model.safetensors`` wins over an index next to it
    (transformers leaves a stale index behind when it re-saves a sharded folder unsharded).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().resolve()
        self._links = hub_cache_root(self.root)
        config_path = self.path(CONFIG_NAME)
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{self.root} has no {CONFIG_NAME}: pass a folder written by save_pretrained"
            )
        self.config: dict[str, Any] = _read_json(config_path)
        if not isinstance(self.config, dict):
            raise ValueError(
                f"{config_path} holds a {type(self.config).__name__}, not a JSON object: "
                "not a model config; pass a folder written by save_pretrained"
            )
        check_config_types(self.config, str(config_path))
        weights, index_path = self.path(WEIGHTS_NAME), self.path(INDEX_NAME)
        self.sharded = not weights.is_file() and index_path.is_file()
        if weights.is_file():
            with _open(weights) as f:
                self.weight_map: dict[str, str] = dict.fromkeys(f.keys(), WEIGHTS_NAME)
        elif self.sharded:
            self.weight_map = self._read_index(index_path)
        else:
            raise FileNotFoundError(
                f"{self.root} has neither {WEIGHTS_NAME} nor {INDEX_NAME}: hf_fp8 reads "
                "safetensors checkpoints (save with safe_serialization, the default)"
            )

    def _read_index(self, index_path: Path) -> dict[str, str]:
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{INDEX_NAME} has no valid weight_map {{tensor: file}}")
        for file in sorted(set(weight_map.values())):
            if not self.path(file).is_file():  # raises UnsafePathError outside the folder
                raise FileNotFoundError(
                    f"{INDEX_NAME} names {file}, which is not in {self.root}: the checkpoint "
                    "is incomplete; download or save it again"
                )
        # one file however spelled (``x``, ``./x``, ``a//x``; ``..`` was refused above), as
        # transformers opens it: raw names made one shard two (R16 5)
        return {k: Path(os.path.normpath(v)).as_posix() for k, v in weight_map.items()}

    def path(self, relpath: str | os.PathLike) -> Path:
        """``root / relpath``, refused when it leaves the folder or goes through a symlink."""
        return contained(self.root, relpath, links_within=self._links)

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        qc = self.config.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise ValueError(
                f"{CONFIG_NAME}'s quantization_config is a {type(qc).__name__}, not a JSON "
                "object: the checkpoint's config is damaged; save or download it again"
            )
        return qc

    @property
    def quant_method(self) -> str | None:
        qc = self.quantization_config
        return None if qc is None else qc.get("quant_method")

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def tensors(self) -> dict[str, TensorInfo]:
        """Header of every tensor (no tensor data is read). A tensor stored in two shards, or
        in a shard the index does not name for it, raises ``ShardKeyError`` naming it and both
        files (every reader of a folder goes through here: inspect, export, import, push)."""
        infos: dict[str, TensorInfo] = {}
        keys_by_file: dict[str, list[str]] = {}
        for file in self.files:
            with _open(self.path(file)) as f:
                keys_by_file[file] = list(f.keys())
                for name in keys_by_file[file]:
                    s = f.get_slice(name)
                    infos.setdefault(name, TensorInfo(s.get_dtype(), tuple(s.get_shape()), file))
        if self.sharded:
            check_shard_keys(keys_by_file, self.weight_map, where=str(self.root), index=INDEX_NAME)
        return infos

    def load_file(self, file: str) -> dict[str, torch.Tensor]:
        with _open(self.path(file)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118

    def get_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors called ``names`` (each file opened once)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.weight_map[name], []).append(name)
        out = {}
        for file, wanted in by_file.items():
            with _open(self.path(file)) as f:
                out.update({name: f.get_tensor(name) for name in wanted})
        return out

    def iter_files(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        for file in self.files:
            yield file, self.load_file(file)

    def other_files(self) -> list[Path]:
        """Files besides config, weights, index and model card (tokenizer, generation config,
        sentence-transformers folders), relative to ``root``; hidden files and weights in
        other formats (``.bin``, ``onnx/`` …) are left out. A symlink raises."""
        return [Path(rel) for rel in companion_files(self.root, skip=self.files)]


def companion_files(root: str | os.PathLike, *, skip: Iterable[str] = ()) -> list[str]:
    """The files of a model folder that travel with its weights (tokenizer, generation config,
    sentence-transformers ``modules.json``, ``1_Pooling/`` …): every file but the config, the
    safetensors weights and index, the model card, ``skip``, hidden files and weights other
    than a pipeline module's (``.bin``, ``onnx/``, ``checkpoint-500/`` …, see
    :func:`_weights`). A symlink among them raises (see :func:`folder_files`)."""
    skipped = {CONFIG_NAME, INDEX_NAME, CARD_NAME, WEIGHTS_NAME, *skip}
    dirs = module_dirs_of(root)
    return folder_files(root, keep=lambda rel: rel not in skipped and not _weights(Path(rel), dirs))


def copy_companion_files(
    source: str | os.PathLike, out_dir: Path, *, skip: Iterable[str] = ()
) -> list[str]:
    """Copy ``companion_files(source)`` that ``out_dir`` does not have yet into ``out_dir``;
    returns the copied relative paths."""
    source = Path(source).expanduser().resolve()
    links_within = hub_cache_root(source)
    copied = []
    for rel in companion_files(source, skip=skip):
        target = contained(out_dir, rel)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(contained(source, rel, links_within=links_within), target)
        copied.append(rel)
    return copied


# config.json fields read as names (transformers' registries and conversion mapping, the
# vLLM fused-sibling families, inspect's rows) and the JSON type each must have
_STRING_FIELDS = ("model_type", "dtype", "torch_dtype")


def check_config_types(config: dict[str, Any], where: str = CONFIG_NAME) -> None:
    """``model_type``, ``dtype`` / ``torch_dtype`` (strings) and ``architectures`` (a list of
    strings) of a checkpoint's config, each when present and not null; raises ``ValueError``
    naming ``where``, the field and the value otherwise (R41 F1: ``"model_type": ["bert"]``
    crashed with ``unhashable type: 'list'``)."""
    for key in _STRING_FIELDS:
        value = config.get(key)
        # a dtype may be one string per sub-config, as transformers writes it (R43 F2)
        per_sub_config = key != "model_type" and isinstance(value, dict)
        if per_sub_config and _non_string_value(value) is None:
            continue
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{where}: {key} is {value!r} ({_json_kind(value)}), but it must be a string "
                f'(e.g. "model_type": "llama", "dtype": "bfloat16"): the config is damaged; '
                "fix it or save / download the checkpoint again"
            )
    archs = config.get("architectures")
    if archs is not None and not (
        isinstance(archs, list) and all(isinstance(a, str) for a in archs)
    ):
        raise ValueError(
            f"{where}: architectures is {archs!r} ({_json_kind(archs)}), but it must be a list "
            'of strings (e.g. "architectures": ["LlamaForCausalLM"]): the config is damaged; '
            "fix it or save / download the checkpoint again"
        )


def _non_string_value(dtypes: dict[str, Any]) -> Any:
    """The first value of a per-sub-config dtype object that is neither a string nor null
    (``None`` when all are)."""
    return next((v for v in dtypes.values() if v is not None and not isinstance(v, str)), None)


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return kinds.get(type(value), "a number" if isinstance(value, (int, float)) else "?")


def _read_json(path: Path) -> Any:
    """The JSON in ``path``; a file that is not JSON (or nested past Python's recursion
    limit, R36) raises ``ValueError`` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ValueError(
            f"{path.name} in {path.parent} is not readable JSON ({reason}): the checkpoint "
            "is damaged; save or download it again"
        ) from None


def pipeline_module_dirs(modules_json: str | bytes) -> set[str]:
    """The folders a sentence-transformers ``modules.json`` names (``1_Pooling``,
    ``2_Dense`` …; the model itself, path ``""``, is not a folder). Names that leave the
    folder (absolute, ``..``) are left out; an unreadable file names none."""
    try:
        modules = json.loads(modules_json)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return set()
    dirs = set()
    for module in modules if isinstance(modules, list) else []:
        path = module.get("path") if isinstance(module, dict) else None
        if not isinstance(path, str):
            continue
        rel = Path(path.strip("/"))
        if rel.parts and not rel.is_absolute() and ".." not in rel.parts:
            dirs.add(rel.as_posix())
    return dirs


def module_dirs_of(root: str | os.PathLike) -> set[str]:
    """:func:`pipeline_module_dirs` of ``root``'s ``modules.json`` (none without one)."""
    root = Path(root).expanduser().resolve()
    path = contained(root, "modules.json", links_within=hub_cache_root(root))
    return pipeline_module_dirs(path.read_bytes()) if path.is_file() else set()


def _weights(rel: Path, module_dirs: Iterable[str] = ()) -> bool:
    """Weights that are not a pipeline module's own: weight files at the top level (the
    model's, in any format) or in any folder but those ``module_dirs`` names (other formats
    ``onnx/``, a Trainer's ``checkpoint-500/``, an ``fp16/`` copy …). A sentence-transformers
    module's weights (``2_Dense/model.safetensors``, its folder named by ``modules.json``)
    are files of their own and travel with the model."""
    if rel.suffix not in _OTHER_WEIGHTS:
        return False
    if len(rel.parts) == 1:
        return True
    return not any(rel.parts[: len(Path(d).parts)] == Path(d).parts for d in module_dirs)


def model_weight_files(files: Iterable[str], module_dirs: Iterable[str] = ()) -> list[str]:
    """The entries of ``files`` (POSIX paths relative to a model folder) that are weights
    but no pipeline module's (see :func:`_weights`): what a conversion never copies or
    downloads."""
    module_dirs = list(module_dirs)
    return [f for f in files if _weights(Path(f), module_dirs)]


def check_out_dir(
    out_dir: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """``out_dir`` after the checks, nothing created: not the source folder (however spelled:
    relative, through a symlink) nor inside it, not a file, and empty unless ``overwrite``."""
    out = Path(out_dir).expanduser()
    if source is not None:
        src = Path(source).expanduser().resolve()
        real = out.resolve()
        if real == src or (out.exists() and os.path.samefile(out, src)):
            raise ValueError(
                f"the output folder {out} is the source folder {src}: write to a new folder "
                "(the source is read while the output is written)"
            )
        if real.is_relative_to(src):
            raise ValueError(
                f"the output folder {out} is inside the source folder {src}: choose a folder "
                "outside it (the source's files would otherwise be copied into themselves)"
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: the output must be a folder")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise OutputExistsError(
            errno.EEXIST,
            f"{out} is not empty: choose a new folder or overwrite=True (only the files "
            "written are replaced, the others are kept)",
            str(out),
        )
    return out


# The previous weights of an output folder: replaced as a whole, so that no old shard or stale
# index survives next to the new weights (the same files transformers' save_pretrained cleans).
WEIGHT_FILES = (WEIGHTS_NAME, INDEX_NAME, "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9]*.safetensors")


@contextmanager
def output_folder(out_dir: str | os.PathLike) -> Iterator[Path]:
    """``atomic_folder(out_dir)`` that also replaces the folder's previous weights."""
    with atomic_folder(out_dir, drop=WEIGHT_FILES) as tmp:
        yield tmp


def copy_other_files(src: Checkpoint, out_dir: Path) -> list[str]:
    """Copy ``src.other_files()`` into ``out_dir``; returns the copied relative paths."""
    return copy_companion_files(src.root, out_dir, skip=src.files)


TensorMap = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def rewrite_tensors(src: Checkpoint, out_dir: Path, convert: TensorMap) -> dict[str, str]:
    """Write every shard of ``src`` through ``convert`` into ``out_dir`` under the same file
    names (``out_dir`` may be ``src.root``: each shard is read fully before it is replaced);
    writes the index when ``src`` is sharded. Returns the new weight map."""
    weight_map: dict[str, str] = {}
    total = 0
    for file, tensors in src.iter_files():
        converted = {k: v.contiguous() for k, v in convert(tensors).items()}
        target = contained(out_dir, file)
        partial = target.with_name(f".{target.name}.partial")
        save_file(converted, str(partial), metadata={"format": "pt"})
        os.replace(partial, target)
        twice = next((k for k in converted if k in weight_map), None)
        if twice is not None:  # never the last copy silently (Checkpoint.tensors refuses first)
            check_shard_keys({weight_map[twice]: [twice], file: [twice]}, where=str(out_dir))
        weight_map.update(dict.fromkeys(converted, file))
        total += sum(t.numel() * t.element_size() for t in converted.values())
    if src.sharded:
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
