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
from hf_fp8.serialization.experts import (
    ExpertGroup,
    expert_modules,
    experts_view,
    fused_experts,
    merged_scale_names,
    split_experts,
)
from hf_fp8.serialization.formats import FORMATS, format_of
from hf_fp8.serialization.layers import LayerPlan, plan_layers
from hf_fp8.serialization.tensors import (
    KV_CACHE_CONFIG_KEYS,
    KV_CACHE_SCALES,
    check_merged_weight_scale,
    check_scale_aliases,
    compute_dtype_of,
    to_hf_fp8_tensors,
)

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
    parameters: int = 0  # elements of every stored tensor except scales / zero points
    fp8_parameters: int = 0  # of which stored as fp8 codes
    # what stays in high precision and why: [{"what", "parameters", "why"}], largest first
    high_precision_parts: list[dict[str, Any]] = field(default_factory=list)
    # an FP8 KV cache: its scale tensors (k_scale, v_scale, …; counted as scales, not
    # parameters) and quantization_config keys (kv_cache_scheme, …), which hf_fp8 does not apply
    kv_cache_scales: list[str] = field(default_factory=list)
    kv_cache_config: dict[str, Any] = field(default_factory=dict)

    @property
    def fp8_share(self) -> float:
        """Share of the parameters stored in FP8 (embeddings and head included)."""
        return self.fp8_parameters / self.parameters if self.parameters else 0.0

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

    @property
    def kv_cache_text(self) -> str | None:
        """What the checkpoint holds of an FP8 KV cache and that hf_fp8 does not apply it;
        ``None`` when it holds nothing of one."""
        if not self.kv_cache_scales and not self.kv_cache_config:
            return None
        parts = []
        if self.kv_cache_scales:
            scales = self.kv_cache_scales
            leaves = sorted({n.rpartition(".")[2] for n in scales})
            parts.append(
                f"{len(scales)} KV-cache / attention scale tensor(s) ({', '.join(leaves)}; "
                f"e.g. {scales[0]})"
            )
        parts += [f"quantization_config.{k}={v!r}" for k, v in self.kv_cache_config.items()]
        intro = "an FP8 KV cache, which hf_fp8 does not apply (it does not quantize the KV cache)"
        if self.format == "hf_fp8":
            # a config key: from_pretrained refuses it (Fp8Config has no such field, R41 F3);
            # scale tensors: from_pretrained reports them UNEXPECTED and drops them
            said = []
            if self.kv_cache_config:
                keys = " and ".join(f"quantization_config.{k}" for k in self.kv_cache_config)
                said.append(
                    f"from_pretrained refuses {keys} (not an Fp8Config field): remove it from "
                    "config.json to load the model"
                )
            if self.kv_cache_scales:
                them = "the scale tensors" if self.kv_cache_config else "them"
                said.append(
                    f"from_pretrained drops {them} (UNEXPECTED keys); delete them from the "
                    "checkpoint"
                )
            what = "; ".join(said) + "; the model runs a high-precision KV cache"
        else:
            what = (
                "hf-fp8 import refuses this checkpoint, naming the tensors and keys to delete "
                "from a copy if a high-precision KV cache is acceptable; serve it with vLLM as "
                "it is"
            )
        return f"{', '.join(parts)}: {intro}: {what}"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "total_bytes": self.total_bytes,
            "bytes_before": self.bytes_before,
            "scheme_text": self.scheme_text,
            "fp8_share": self.fp8_share,
            "kv_cache_text": self.kv_cache_text,
        }


def _config(checkpoint: Checkpoint | HubHeaders, fmt: str) -> tuple[Fp8Config | None, str | None]:
    # the FP8 KV cache is reported on its own (kv_cache_config), not as the scheme: in an
    # hf_fp8 folder its keys are fields Fp8Config refuses (the kv cache row says so, R41 F3)
    qc = {k: v for k, v in checkpoint.quantization_config.items() if k not in KV_CACHE_CONFIG_KEYS}
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


def _merged_codes_shape(group: ExpertGroup, tensors: dict[str, TensorInfo]) -> tuple[int, int, int]:
    """``[E, out, in]`` of a group's codes, stored merged or (as transformers saves them)
    one linear per expert and source."""
    if group.name in tensors:
        e, out_features, in_features = tensors[group.name].shape
        return e, out_features, in_features
    first = tensors[f"{group.per_expert(0, 0)}.weight"]
    return group.num_experts, sum(group.rows), first.shape[1]


def check_stored_tensors(
    checkpoint: Checkpoint,
    fmt: str,
    plan: LayerPlan,
    config: Fp8Config,
    groups: dict[str, ExpertGroup] | None = None,
) -> None:
    """The checks import runs, on what inspect can afford: the fp8 weights' dtypes (headers)
    and every scale's values (small tensors; merged block scales checked against the merged
    codes, other merged expert scales split per expert). Raises
    ``CheckpointTensorError`` naming the tensor."""
    groups = groups or {}
    tensors = checkpoint.tensors()
    wanted = _FP8_NAME[str(config.fp8_format)]
    for name in groups:
        if name in tensors and tensors[name].dtype != wanted:
            raise CheckpointTensorError(
                f"{name}: stored as {tensors[name].dtype}, but the config says "
                f"fp8_format={config.fp8_format!r}: the config and the stored bytes disagree"
            )
    for module in plan.fp8:
        info = tensors.get(f"{module}.weight")
        if info is None:  # a per-expert linear of merged expert codes (checked above)
            continue
        if info.dtype != wanted:
            raise CheckpointTensorError(
                f"{module}.weight: stored as {info.dtype}, but the config says "
                f"fp8_format={config.fp8_format!r}: the config and the stored bytes disagree"
            )
    names = [n for n in tensors if module_of(n)[0] in plan.fp8 and module_of(n)[1] in _SCALE_LEAVES]
    names += [n for n in merged_scale_names(groups) if n in tensors]
    loaded = checkpoint.get_tensors(names)
    dtype = compute_dtype_of(checkpoint.config)
    if config.weight_granularity == "block":
        # checked merged, against the merged codes: a block may span gate and up, which
        # only an export (one scale grid per expert linear) has to refuse
        for group in groups.values():
            name = f"{group.name}_weight_scale"
            if name in loaded:
                shape = _merged_codes_shape(group, tensors)
                check_merged_weight_scale(name, loaded.pop(name), shape, config, dtype)
    scales = split_experts(loaded, groups, config)
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
    if fmt in FORMATS:  # headers only: a Hub repo's too
        check_scale_aliases(tensors, FORMATS[fmt].import_renames)
    config, note = _config(checkpoint, fmt) if fmt != "unquantized" else (None, None)
    try:
        view, groups = experts_view(checkpoint.config.get("model_type"), tensors)
    except ValueError as err:
        view, groups, note = dict(tensors), {}, note or str(err)
    experts = expert_modules(groups)
    fp8_modules = {
        module_of(n)[0]
        for n, i in view.items()
        if i.dtype in FP8_DTYPE_NAMES and module_of(n)[1] == "weight"
    }
    merged_scales = set(merged_scale_names(groups))
    fused_codes, fused_scales = fused_experts(tensors) if fmt == "hf_fp8" else (set(), set())
    merged_scales |= fused_scales
    summary = CheckpointSummary(
        path=str(checkpoint.root),
        format=fmt,
        architecture=(checkpoint.config.get("architectures") or [None])[0],
        compute_dtype=_compute_dtype(checkpoint.config, tensors),
        scheme=None if config is None else _scheme(config),
        # experts listed once per merged projection, not once per expert
        fp8_layers=sorted(
            {experts[m][0] if m in experts else m for m in fp8_modules}
            | {n for n in fused_codes if module_of(n)[0] not in fp8_modules}
        ),
        note=note,
    )
    plan = None
    if fp8_modules:
        try:
            plan = plan_layers(checkpoint.config, view, experts=experts)
        except CheckpointTensorError:
            raise
        except ValueError as err:
            summary.note = summary.note or str(err)
        else:
            summary.high_precision_layers = plan.high_precision
            if config is not None and isinstance(checkpoint, Checkpoint):
                check_stored_tensors(checkpoint, fmt, plan, config, groups)
    qc = checkpoint.quantization_config
    if isinstance(qc, dict):
        summary.kv_cache_config = {k: qc[k] for k in KV_CACHE_CONFIG_KEYS if qc.get(k) is not None}
    high: dict[str, list[Any]] = {}
    for name, info in tensors.items():
        module, leaf = module_of(name)
        if leaf in KV_CACHE_SCALES:  # an FP8 KV cache's scales, on any module
            summary.kv_cache_scales.append(name)
            summary.scale_bytes += info.nbytes
            continue
        fp8 = info.dtype in FP8_DTYPE_NAMES and (
            (module in fp8_modules and leaf == "weight") or name in groups or name in fused_codes
        )
        if fp8:
            summary.fp8_weight_bytes += info.nbytes
        elif (module in fp8_modules and leaf in _SCALE_LEAVES) or name in merged_scales:
            summary.scale_bytes += info.nbytes
            continue
        else:
            summary.other_bytes += info.nbytes
        if leaf in ("weight_zero_point", "input_zero_point"):
            continue
        summary.parameters += info.numel
        if fp8:
            summary.fp8_parameters += info.numel
        else:
            what, why = high_precision_reason(name, info, plan, checkpoint.quantization_config)
            entry = high.setdefault(what, [0, why])
            entry[0] += info.numel
    summary.kv_cache_scales.sort()
    summary.high_precision_parts = [
        {"what": what, "parameters": n, "why": why}
        for what, (n, why) in sorted(high.items(), key=lambda kv: -kv[1][0])
    ]
    return summary


_ROUTER_LEAVES = ("gate", "router", "shared_expert_gate", "gating")


def high_precision_reason(
    name: str, info: TensorInfo, plan: LayerPlan | None, qc: dict[str, Any] | None
) -> tuple[str, str]:
    """``(kind, why)`` of a tensor kept in high precision, from its name and shape (the
    words of ``hf_fp8.modules.selection``'s keep rules)."""
    module, leaf = module_of(name)
    child = module.rpartition(".")[2]
    high = set(plan.high_precision) if plan is not None else set()
    if "embed" in name or "wte" in name or "wpe" in name:
        return "embeddings", "a lookup table, not a matmul (FP8 would save memory but no compute)"
    if leaf == "bias":
        return "biases", "added after the matmul in the compute dtype (1-D, tiny)"
    if len(info.shape) <= 1:
        return "norms and other 1-D tensors", "vectors, not matmul weights (tiny)"
    if child in _ROUTER_LEAVES or "router" in module:
        return "MoE routers", (
            "kept in high precision on purpose: they pick the experts, and a flipped top-k "
            "choice costs more than the tiny matmul saves"
        )
    fused_experts = "experts" in name and len(info.shape) == 3
    if module in high or fused_experts:
        qc = qc or {}
        skipped = [
            *(qc.get("modules_to_not_convert") or []),
            *(qc.get("ignore") or []),
            *(qc.get("ignored_layers") or []),
        ]
        # a layer renamed on save (ViT) is named in modules_to_not_convert by its model name
        names = {module, plan.model_names.get(module, module) if plan is not None else module}
        if any(n == s or n.endswith(f".{s}") for n in names for s in skipped):
            return "modules_to_not_convert", (
                "named in modules_to_not_convert (lm_head and task heads such as score / "
                "classifier by default: the output head is the layer most sensitive to FP8 "
                "rounding; a task head is small and trained with the task)"
            )
    if module in high:
        return "high-precision linears", (
            "a linear the checkpoint stores in high precision (kept by hf_fp8.modules.selection "
            "or not quantized by the tool that wrote it)"
        )
    if fused_experts:
        return "experts not in FP8", (
            "MoE experts that Fp8Experts cannot carry (hf_fp8.modules.fp8_experts."
            "unsupported_reason names why)"
        )
    return "other", "not a linear layer hf_fp8 converts"


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
