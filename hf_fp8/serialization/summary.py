"""What a checkpoint folder holds: format, FP8 scheme, layers and bytes (headers only)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_fp8.config import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.recipe import ActivationGranularity, Granularity
from hf_fp8.serialization.checkpoint import (
    FP8_DTYPE_NAMES,
    Checkpoint,
    TensorInfo,
    check_repo_id,
    module_of,
    resolve_checkpoint,
)
from hf_fp8.serialization.formats import FORMATS, format_of
from hf_fp8.serialization.layers import LayerPlan, plan_layers
from hf_fp8.serialization.tensors import compute_dtype_of, to_hf_fp8_tensors

if TYPE_CHECKING:
    from hf_fp8.serialization.remote import HubHeaders

_SCALE_LEAVES = (
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "activation_scale",
    "weight_zero_point",
    "input_zero_point",
)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# Words for every granularity of hf_fp8.recipe (checked complete at import).
_WEIGHT_WORDS = {
    Granularity.TENSOR: "per tensor",
    Granularity.ROW: "per output channel",
    Granularity.BLOCK: "per block",
}
_ACT_WORDS = {
    ActivationGranularity.TENSOR: "per tensor",
    ActivationGranularity.TOKEN: "per token",
    ActivationGranularity.BLOCK: "per 1×{k} group",
}
if set(_WEIGHT_WORDS) != set(Granularity) or set(_ACT_WORDS) != set(ActivationGranularity):
    raise RuntimeError("summary's scheme words miss a hf_fp8.recipe granularity")


def weight_words(scheme: dict[str, Any]) -> str:
    """``"per output channel"``, ``"per tensor"`` or ``"per block 128×128"``."""
    words = _WEIGHT_WORDS[scheme["weight_granularity"]]
    if scheme["weight_granularity"] == "block":
        words += " {}×{}".format(*scheme["block_size"])
    return words


def activation_words(scheme: dict[str, Any], compute_dtype: str | None = None) -> str:
    """``"e4m3 per token (dynamic scales)"`` or ``"float32 (weight-only)"``."""
    if scheme["activation_scheme"] == "weight_only":
        return f"{compute_dtype or 'high precision'} (weight-only)"
    acts = _ACT_WORDS[scheme["activation_granularity"]].format(k=scheme["block_size"][1])
    kind = "static scales" if scheme["activation_scheme"] == "static" else "dynamic scales"
    return f"{scheme['fp8_format']} {acts} ({kind})"


def describe_scheme(scheme: dict[str, Any], compute_dtype: str | None = None) -> str:
    """One line, e.g. ``"dynamic: e4m3 weights per output channel, activations e4m3 per
    token (dynamic scales)"``."""
    return (
        f"{scheme['activation_scheme']}: {scheme['fp8_format']} weights {weight_words(scheme)}, "
        f"activations {activation_words(scheme, compute_dtype)}"
    )


@dataclass
class CheckpointSummary:
    """Summary of one checkpoint; ``to_dict()`` is JSON-ready."""

    path: str
    format: str
    architecture: str | None
    compute_dtype: str | None
    scheme: dict[str, Any] | None
    fp8_layers: list[str] = field(default_factory=list)
    high_precision_layers: list[str] | None = None
    fp8_weight_bytes: int = 0
    scale_bytes: int = 0
    other_bytes: int = 0
    note: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.fp8_weight_bytes + self.scale_bytes + self.other_bytes

    @property
    def bytes_before(self) -> int:
        """Bytes the same tensors take with the fp8 weights in ``compute_dtype``."""
        per = _DTYPE_BYTES.get(self.compute_dtype or "", 2)
        return self.fp8_weight_bytes * per + self.other_bytes

    @property
    def scheme_text(self) -> str:
        if self.scheme is None:
            return self.note or "not FP8"
        return describe_scheme(self.scheme, self.compute_dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "total_bytes": self.total_bytes,
            "bytes_before": self.bytes_before,
            "scheme_text": self.scheme_text,
        }


def _config(checkpoint: Checkpoint | HubHeaders, fmt: str) -> tuple[Fp8Config | None, str | None]:
    qc = checkpoint.quantization_config
    try:
        if fmt == "hf_fp8":
            return Fp8Config.from_dict(qc), None
        if fmt in FORMATS:
            return Fp8Config(**FORMATS[fmt].import_kwargs(qc)), None
        return None, f"{fmt}: not an FP8 format hf_fp8 reads"
    except ValueError as err:
        return None, str(err)


def _scheme(config: Fp8Config) -> dict[str, Any]:
    keys = ("activation_scheme", "weight_granularity", "activation_granularity", "block_size")
    scheme = {k: getattr(config, k) for k in keys}
    scheme["fp8_format"] = config.fp8_format
    return scheme


_FP8_NAME = {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}


def check_stored_tensors(
    checkpoint: Checkpoint, fmt: str, plan: LayerPlan, config: Fp8Config
) -> None:
    """The checks import runs, on what inspect can afford: the fp8 weights' dtypes (headers)
    and every scale's values (small tensors). Raises ``CheckpointTensorError`` naming the
    tensor."""
    tensors = checkpoint.tensors()
    wanted = _FP8_NAME[str(config.fp8_format)]
    for module in plan.fp8:
        info = tensors[f"{module}.weight"]
        if info.dtype != wanted:
            raise CheckpointTensorError(
                f"{module}.weight: stored as {info.dtype}, but the config says "
                f"fp8_format={config.fp8_format!r}: the config and the stored bytes disagree"
            )
    names = [n for n in tensors if module_of(n)[0] in plan.fp8 and module_of(n)[1] in _SCALE_LEAVES]
    scales = checkpoint.get_tensors(names)
    dtype = compute_dtype_of(checkpoint.config)
    if fmt in FORMATS:
        FORMATS[fmt].import_tensors(scales, plan, config, compute_dtype=dtype)
    else:
        to_hf_fp8_tensors(scales, plan, config, compute_dtype=dtype)


def _compute_dtype(config: dict[str, Any], tensors: dict[str, TensorInfo]) -> str | None:
    dtype = config.get("dtype") or config.get("torch_dtype")
    if isinstance(dtype, str) and dtype in _DTYPE_BYTES:
        return dtype
    for info in tensors.values():
        if info.dtype in _SAFETENSORS_DTYPES:
            return _SAFETENSORS_DTYPES[info.dtype]
    return None


def summarize(checkpoint: Checkpoint | HubHeaders) -> CheckpointSummary:
    """Summary of an opened checkpoint (a folder, or a Hub repo's headers)."""
    tensors = checkpoint.tensors()
    fmt = format_of(checkpoint.quantization_config)
    config, note = _config(checkpoint, fmt) if fmt != "unquantized" else (None, None)
    fp8_modules = {
        module_of(n)[0]
        for n, i in tensors.items()
        if i.dtype in FP8_DTYPE_NAMES and module_of(n)[1] == "weight"
    }
    summary = CheckpointSummary(
        path=str(checkpoint.root),
        format=fmt,
        architecture=(checkpoint.config.get("architectures") or [None])[0],
        compute_dtype=_compute_dtype(checkpoint.config, tensors),
        scheme=None if config is None else _scheme(config),
        fp8_layers=sorted(fp8_modules),
        note=note,
    )
    if fp8_modules:
        try:
            plan = plan_layers(checkpoint.config, tensors)
        except CheckpointTensorError:
            raise
        except ValueError as err:
            summary.note = summary.note or str(err)
        else:
            summary.high_precision_layers = plan.high_precision
            if config is not None and isinstance(checkpoint, Checkpoint):
                check_stored_tensors(checkpoint, fmt, plan, config)
    for name, info in tensors.items():
        module, leaf = module_of(name)
        if module in fp8_modules and leaf == "weight":
            summary.fp8_weight_bytes += info.nbytes
        elif module in fp8_modules and leaf in _SCALE_LEAVES:
            summary.scale_bytes += info.nbytes
        else:
            summary.other_bytes += info.nbytes
    return summary


def inspect_checkpoint(
    model_id: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
) -> CheckpointSummary:
    """Format, FP8 scheme, layers and bytes of a checkpoint folder or Hub repo id. Only tensor
    headers are read: a repo id's through ``HfApi.get_safetensors_metadata`` (the local Hub
    cache when ``HF_HUB_OFFLINE=1``), no weights are downloaded."""
    path = Path(model_id).expanduser()
    if path.is_dir() or path.exists():
        return summarize(Checkpoint(resolve_checkpoint(path)))
    from hf_fp8.serialization.remote import hub_headers

    check_repo_id(str(model_id))
    return summarize(hub_headers(str(model_id), revision=revision, token=token))
