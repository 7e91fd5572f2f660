"""The facts a model card states, gathered from a loaded model or from a checkpoint folder."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from itertools import chain
from typing import Any

import torch
from torch import nn

from hf_fp8.calibration.calibrate import CALIBRATED_HOOKS
from hf_fp8.config import Fp8Config
from hf_fp8.modules import Fp8Experts, Fp8Linear, unconverted_linears
from hf_fp8.serialization.summary import CheckpointSummary, describe_scheme

_SCHEME_KEYS = ("activation_scheme", "weight_granularity", "activation_granularity", "block_size")
# The built-in model of hf_fp8.utils.minilm, by its Hub id (used for the card's base_model).
MINILM_REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"
# A model's card facts (base model, fidelity) in its __dict__: hf_fp8.hub.hooks' state.
_STATE = "_hf_fp8_card"
# key of that state: the compute dtype the recorded fidelity figures were measured in
FIDELITY_DTYPE = "fidelity_dtype"


@dataclass
class CardInfo:
    """Everything the card templates (``hub/templates/``) use; JSON round-trips (embedded in the card)."""

    format: str = "hf_fp8"
    architecture: str | None = None
    base_model: str | None = None
    repo_id: str | None = None
    compute_dtype: str | None = None
    scheme: dict[str, Any] | None = None
    fp8_layers: int = 0
    high_precision_layers: list[str] = field(default_factory=list)
    bytes_before: int | None = None
    bytes_after: int | None = None
    fidelity: dict[str, Any] = field(default_factory=dict)
    fp8_share: float | None = None  # share of the parameters stored in FP8 (scales excluded)
    # what stays in high precision and why: [{"what", "parameters", "why"}] (from a checkpoint)
    high_precision_parts: list[dict[str, Any]] = field(default_factory=list)
    # the model's whole quantization_config (from a loaded model): a later card carries this
    # card's figures over only for the same one (hf_fp8.hub.card.same_model)
    quantization_config: dict[str, Any] | None = None
    # digest of the model's static input scales (from a loaded static model): figures measured
    # with other scales (before a calibration) are not carried over (hub.card.same_model)
    static_scales: str | None = None
    # whether the model has FP8 MoE experts (None: not known, e.g. a card of an older
    # hf_fp8): what vLLM's fused-MoE loader accepts decides the card's export / serve lines
    fp8_experts: bool | None = None
    hf_fp8_version: str = field(default_factory=lambda: _version())

    @property
    def scheme_text(self) -> str:
        return describe_scheme(self.scheme, self.compute_dtype) if self.scheme else "unknown"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CardInfo:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _version() -> str:
    from hf_fp8 import __version__

    return __version__


def hub_model_id(name: str | os.PathLike | None) -> str | None:
    """``name`` when it reads as a Hub repo id (not a local folder), the built-in MiniLM's
    Hub id for its local folder, else ``None``."""
    if not name:
        return None
    name = str(name)
    try:
        from hf_fp8.utils.minilm import default_model_path

        if os.path.isdir(name) and os.path.samefile(name, default_model_path()):
            return MINILM_REPO_ID
    except (ImportError, OSError):
        pass
    if os.path.exists(name) or name.startswith((".", "/", "~")):
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name if "/" in name else None


def _scheme_dict(config: Fp8Config) -> dict[str, Any]:
    scheme = {k: getattr(config, k) for k in _SCHEME_KEYS}
    scheme["fp8_format"] = config.fp8_format
    scheme["block_size"] = list(scheme["block_size"])
    return scheme


def _is_scale(name: str) -> bool:
    return name.endswith(("weight_scale", "input_scale"))


def model_bytes(model: nn.Module) -> tuple[int, int, float | None]:
    """``(before, after, fp8_share)``: bytes of the model's tensors with each FP8 weight in its
    compute dtype (no scales), and as they are (each shared tensor counted once); the share of
    the parameters (buffers and scales excluded) stored in FP8."""
    before = after = fp8 = total = 0
    seen: set[int] = set()
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        own = chain(params.items(), module.named_buffers(recurse=False))
        fp8_module = isinstance(module, (Fp8Linear, Fp8Experts))
        for name, tensor in own:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            nbytes = tensor.numel() * tensor.element_size()
            after += nbytes
            if fp8_module and _is_scale(name):
                continue
            total += tensor.numel() if name in params else 0
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                fp8 += tensor.numel()
                before += tensor.numel() * module.compute_dtype.itemsize
            else:
                before += nbytes
    return before, after, (fp8 / total if total else None)


def info_from_model(model: nn.Module, **overrides: Any) -> CardInfo:
    """Card facts of a loaded hf_fp8 model (``overrides`` win, e.g. ``repo_id``)."""
    config = getattr(model, "config", None)
    qc = getattr(config, "quantization_config", None)
    if not isinstance(qc, Fp8Config):
        raise ValueError("the model has no hf_fp8 quantization_config: it is not an hf_fp8 model")
    high = unconverted_linears(model)
    before, after, share = model_bytes(model)
    extra = dict(getattr(model, _STATE, None) or {})
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    info = CardInfo(
        format="hf_fp8",
        architecture=architectures[0],
        base_model=extra.get("base_model"),
        compute_dtype=compute_dtype_name(model),
        scheme=_scheme_dict(qc),
        fp8_layers=fp8_layer_count(model),
        high_precision_layers=high,
        bytes_before=before,
        bytes_after=after,
        fidelity=recorded_fidelity(model),
        fp8_share=share,
        quantization_config=qc.to_dict(),
        static_scales=static_scales_digest(model),
        fp8_experts=any(isinstance(m, Fp8Experts) for m in model.modules()),
    )
    for key, value in overrides.items():
        setattr(info, key, value)
    return info


def compute_dtype_name(model: nn.Module) -> str | None:
    """``"float32"``, ``"bfloat16"`` …: the dtype ``model`` computes in (``model.dtype``)."""
    return str(getattr(model, "dtype", "")).replace("torch.", "") or None


def recorded_fidelity(model: nn.Module) -> dict[str, Any]:
    """The fidelity figures recorded for ``model``'s card (``hf_fp8.set_card_info``, or the
    card of the checkpoint it was loaded from) that still describe it: none when they were
    measured in another compute dtype than the model's now (e.g. after
    ``model.to(torch.bfloat16)``; one warning naming both dtypes)."""
    state = model.__dict__.get(_STATE)
    if not isinstance(state, dict) or not state.get("fidelity"):
        return {}
    figures = dict(state["fidelity"])
    measured, current = state.get(FIDELITY_DTYPE), compute_dtype_name(model)
    if measured is not None and measured != current:
        warnings.warn(
            f"hf_fp8: the model card's fidelity figures were measured in {measured} and the "
            f"model now computes in {current}; they do not describe it and are left out of "
            "its card. Measure again and record them with "
            "hf_fp8.set_card_info(model, fidelity={...})",
            UserWarning,
            stacklevel=3,
        )
        return {}
    return figures


def fp8_layer_count(model: nn.Module) -> int:
    """FP8 linear layers as a checkpoint's summary counts them: each ``Fp8Linear``, and each
    projection of an ``Fp8Experts`` (``gate_up_proj``, ``down_proj``)."""
    return sum(
        1 if isinstance(m, Fp8Linear) else len(m.layout.projections)
        for m in model.modules()
        if isinstance(m, (Fp8Linear, Fp8Experts))
    )


# the digest of static input scales that are offloaded (on meta): no earlier card matches it
UNKNOWN_SCALES = "unknown (offloaded)"


def static_scales_digest(model: nn.Module) -> str | None:
    """A digest of every static input scale of ``model`` (``Fp8Linear.input_scale``,
    ``Fp8Experts.<proj>_input_scale``, by name and exact value); ``None`` without any, and
    :data:`UNKNOWN_SCALES` when one is offloaded (on meta: figures are then never carried)."""
    digest = hashlib.sha256()
    found = False
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            scales = [("input_scale", module.input_scale)]
        elif isinstance(module, Fp8Experts):
            scales = [
                (f"{proj}_input_scale", getattr(module, f"{proj}_input_scale", None))
                for proj in module.layout.projections
            ]
        else:
            continue
        for key, scale in scales:
            if scale is None:
                continue
            if scale.is_meta:
                return UNKNOWN_SCALES
            value = scale.detach().to(device="cpu", dtype=torch.float32).contiguous()
            digest.update(f"{name}.{key}:{list(value.shape)}:".encode())
            digest.update(value.numpy().tobytes())
            found = True
    return digest.hexdigest()[:16] if found else None


def forget_measured_figures(model: nn.Module) -> None:
    """After ``hf_fp8.calibrate`` set new static scales: the fidelity figures recorded for
    ``model``'s card were measured with the old ones, so they leave it (one warning naming
    them; measure again and record with ``hf_fp8.set_card_info``)."""
    state = model.__dict__.get(_STATE)
    figures = state.pop("fidelity", None) if isinstance(state, dict) else None
    if figures:
        shown = ", ".join(f"{k} = {v}" for k, v in list(figures.items())[:4])
        warnings.warn(
            f"hf_fp8: calibrate set new static input scales; the model card's figures were "
            f"measured before ({shown}) and no longer hold, so they are dropped. Measure "
            "again and record them with hf_fp8.set_card_info(model, fidelity={...})",
            UserWarning,
            stacklevel=4,
        )


if forget_measured_figures not in CALIBRATED_HOOKS:
    CALIBRATED_HOOKS.append(forget_measured_figures)


def checkpoint_has_fp8_experts(path: str | os.PathLike) -> bool | None:
    """Whether the checkpoint folder ``path`` stores FP8 MoE experts, found as ``summarize``
    finds them (tensor headers only): expert groups of fp8 codes, merged or one per expert
    (``serialization.experts.experts_view``), or fused 3-D fp8 codes (``fused_experts``).
    ``None`` when it cannot be read (a Hub repo's headers, a damaged folder)."""
    from hf_fp8.serialization.checkpoint import Checkpoint
    from hf_fp8.serialization.experts import experts_view, fused_experts

    try:
        checkpoint = Checkpoint(path)
        tensors = checkpoint.tensors()
        _, groups = experts_view(checkpoint.config.get("model_type"), tensors)
    except (OSError, ValueError, TypeError):
        return None
    return bool(groups) or bool(fused_experts(tensors)[0])


def info_from_summary(summary: CheckpointSummary, **overrides: Any) -> CardInfo:
    """Card facts of a checkpoint folder (see ``hf_fp8.serialization.inspect_checkpoint``)."""
    info = CardInfo(
        format=summary.format,
        architecture=summary.architecture,
        compute_dtype=summary.compute_dtype,
        scheme=summary.scheme,
        fp8_layers=len(summary.fp8_layers),
        high_precision_layers=list(summary.high_precision_layers or []),
        bytes_before=summary.bytes_before,
        bytes_after=summary.total_bytes,
        fp8_share=summary.fp8_share if summary.parameters else None,
        high_precision_parts=list(summary.high_precision_parts),
        fp8_experts=checkpoint_has_fp8_experts(summary.path) if summary.scheme else None,
    )
    for key, value in overrides.items():
        setattr(info, key, value)
    return info
