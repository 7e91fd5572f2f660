"""Validation of what ``from_pretrained`` loaded into a model (DESIGN §8, issue 12 §2).

transformers' loader sets parameters directly and never calls
``Module._load_from_state_dict``, so the quantizer checks the loaded model as a whole, after
the weights are in: every ``Fp8Linear``'s fp8 weight and scales, and every other parameter
that holds fp8 codes. ``Fp8HfQuantizer.get_new_dtype`` makes sure these arrive in the dtype
stored on disk (the loader would otherwise cast them to the meta dtype, hiding a wrong one).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hf_fp8.modules import Fp8Linear, keep_reason, matches_module
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import weight_scale_shape
from hf_fp8.modules.weight_reads import closing_hint, describe_settings, opening_settings
from hf_fp8.numerics import AMAX_EPS, fp8_dtype, fp8_max, is_fp8
from hf_fp8.numerics.checks import (
    CheckpointTensorError,
    check_fp8_tensor,
    check_scale_tensor,
    max_scale,
    min_input_scale,
)
from hf_fp8.quantizer.scale_granularity import (
    ScaledWeight,
    block_advice,
    describe_granularity,
    local_checkpoint_files,
    stored_scaled_weights,
)
from hf_fp8.utils.folders import read_index_json

# Tensors of an Fp8Linear that a checkpoint stores in fp8 / fp32 and that must arrive uncast.
FP8_LINEAR_TENSORS = ("weight", "weight_scale", "input_scale")

_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def stored_dtype(key: str, stored: Any) -> torch.dtype:
    """The dtype of checkpoint tensor ``key`` as stored (a safetensors slice's header, or a
    tensor's dtype); one hf_fp8 never writes is refused, named."""
    if not hasattr(stored, "get_dtype"):
        return stored.dtype
    name = str(stored.get_dtype())
    dtype = _SAFETENSORS_DTYPES.get(name)
    if dtype is None:
        raise CheckpointTensorError(
            f"{key}: stored as {name}, a dtype hf_fp8 never writes; re-export the checkpoint "
            "with hf_fp8 (save_pretrained)"
        )
    return dtype


def check_stored_tensor(
    key: str, stored: Any, *, fp8_dtype: torch.dtype, read_scales: bool = True
) -> None:
    """Check one checkpoint tensor of an FP8 module before the loader reads it.

    ``key`` ends with ``_scale`` for a scale (``weight_scale``, ``input_scale``,
    ``<proj>_weight_scale``); anything else holds fp8 codes. ``stored`` is what
    transformers' loader holds: a lazy safetensors slice (``get_dtype``, ``get_shape``) or
    a tensor. The dtype comes from the header (no bytes read). ``read_scales`` also reads a
    scale (a few bytes) and checks its values against the widest compute dtype's bound:
    needed for disk-offloaded layers, whose tensors never reach the module. Everything that
    does reach a module is checked again, exactly, after loading.
    """
    dtype = stored_dtype(key, stored)
    is_scale = key.endswith("_scale")
    if dtype == (torch.float32 if is_scale else fp8_dtype) and not (is_scale and read_scales):
        return  # the common case: a string compare, nothing read
    if not is_scale:  # fp8 codes: Fp8Linear "weight", Fp8Experts "<proj>"
        shape = tuple(stored.get_shape()) if hasattr(stored, "get_shape") else stored.shape
        meta = torch.empty(shape, dtype=dtype, device="meta")
        check_fp8_tensor(key, meta, dtype=fp8_dtype, shape=None)
        return
    if dtype != torch.float32 or not read_scales:
        raise CheckpointTensorError(f"{key}: a scale must be float32, found {dtype}")
    value = stored[...] if hasattr(stored, "get_dtype") else stored
    low = min_input_scale(fp8_dtype) if key.endswith("input_scale") else None
    check_scale_tensor(key, value, max_value=max_scale(fp8_dtype, torch.float32), min_value=low)


def fitting_granularity(
    shape: tuple[int, ...],
    out_features: int,
    in_features: int,
    block_size: tuple[int, int],
    *,
    others: Iterable[ScaledWeight] | None = (),
) -> tuple[str, bool] | None:
    """The ``weight_granularity`` (and ``block_size``) whose weight scale of an
    ``[out, in]`` weight has ``shape``, as config words, and whether the shapes determine it
    (see :func:`block_advice`; ``others``: the other weights of the checkpoint, whose scale
    shapes narrow the block size; ``None`` when they could not be read, R16 4); ``None`` when
    none does."""
    for granularity in ("tensor", "row"):
        if shape == weight_scale_shape(out_features, in_features, granularity, block_size):
            return describe_granularity(granularity, block_size), True
    if len(shape) != 2 or min(shape) < 1:
        return None
    this = ((out_features, in_features), tuple(shape))
    return block_advice([this, *(others or ())], block_size, complete=others is not None)


def check_weight_scale_shape(
    key: str,
    shape: tuple[int, ...],
    features: tuple[int, ...],
    recipe: Any,
    *,
    root: str,
    files: Sequence[str] | None = None,
) -> None:
    """Refuse a stored weight scale (``key``) whose ``shape`` is not what the config's
    ``weight_granularity`` / ``block_size`` give, before loading, naming the granularity the
    file holds (transformers' own size report advises ``ignore_mismatched_sizes=True``, which
    would re-initialise the scales). ``features``: ``(out, in)`` of an ``Fp8Linear`` weight
    (its ``weight_scale``), or ``(E, out, in)`` of an ``Fp8Experts`` projection (its
    ``<proj>_weight_scale``, one scale per expert: ``[E, *weight scale]``). ``files``: the
    checkpoint files transformers reads (default: those of the local folder ``root``; none for
    a Hub id), whose other weights' scale shapes narrow the advised block size."""
    granularity = str(getattr(recipe.weight_granularity, "value", recipe.weight_granularity))
    experts, (out_features, in_features) = features[:-2], features[-2:]
    per_weight = weight_scale_shape(out_features, in_features, granularity, recipe.block_size)
    expected = (*experts, *per_weight)
    if tuple(shape) == tuple(expected):
        return
    config = os.path.join(root, "config.json") if root and os.path.isdir(root) else "config.json"
    fits = None
    if tuple(shape[: len(experts)]) == tuple(experts):
        fits = fitting_granularity(
            tuple(shape[len(experts) :]),
            out_features,
            in_features,
            recipe.block_size,
            others=_other_weights(root, files) if len(shape) - len(experts) == 2 else (),
        )
    weight = f"a {[out_features, in_features]} weight" + (
        f" of {experts[0]} experts" if experts else ""
    )
    if fits is None:
        fix = (
            f"That shape fits no weight granularity of {weight} (no single block size gives "
            "the checkpoint's scale shapes): re-export the checkpoint with hf_fp8 "
            "(save_pretrained)"
        )
    elif fits[1]:
        fix = (
            f"The stored scales are {fits[0]}: set that in the quantization_config of "
            f"{config} (save_pretrained writes the one the scales were made with)"
        )
    else:
        fix = (
            f"The stored scales are {fits[0]}. Set block_size in the quantization_config of "
            f"{config} to the one the checkpoint was quantized with (save_pretrained writes "
            "it): a guess that fits the shapes loads a wrong model without an error"
        )
    says = describe_granularity(granularity, recipe.block_size)
    raise CheckpointTensorError(
        f"{key}: stored with shape {list(shape)} in {checkpoint_file(root, key)}, but the "
        f"quantization_config of {config} says {says} "
        f"(a weight scale of shape {list(expected)}). {fix}. ignore_mismatched_sizes=True "
        "does not apply: it would re-initialise the scales"
    )


def _other_weights(root: str, files: Sequence[str] | None) -> list[ScaledWeight] | None:
    """The stored scaled weights of the checkpoint (:func:`stored_scaled_weights`) of
    ``files``, else of the local folder ``root``; ``None`` when they cannot be read."""
    if files is None:
        files = local_checkpoint_files(root)
    return stored_scaled_weights(files) if files else None


def experts_weight_features(name: str, module: Fp8Experts) -> dict[str, tuple[int, int, int]]:
    """Checkpoint key of each projection's weight scale of one ``Fp8Experts`` (``name``) ->
    ``(E, out, in)`` of its weights: the ``features`` of :func:`check_weight_scale_shape`."""
    return {
        f"{name}.{proj}_weight_scale": tuple(module.layout.shape(proj))
        for proj in module.layout.projections
    }


def checkpoint_file(root: str, key: str) -> str:
    """The file of checkpoint ``root`` (``config.name_or_path``) that holds ``key``, for
    errors: ``model.safetensors`` (transformers reads it before any index), the shard its
    index names, or ``root`` itself (a Hub id, a key the loader renamed, an index that does
    not parse). Only names a file; reads nothing but the index."""
    if not root or not os.path.isdir(root):
        return root or "the checkpoint"
    single = os.path.join(root, "model.safetensors")
    if os.path.isfile(single):
        return single
    index = os.path.join(root, "model.safetensors.index.json")
    try:
        shard = read_index_json(index).get("weight_map", {}).get(key)
    except (OSError, ValueError, AttributeError):
        shard = None
    return os.path.join(root, os.path.basename(shard)) if isinstance(shard, str) else root


def is_bias_dtype(dtype: torch.dtype) -> bool:
    """A dtype a bias (and so a compute dtype) may have: a float that is not fp8."""
    return dtype.is_floating_point and not is_fp8(dtype)


def check_bias(key: str, dtype: torch.dtype, *, source: str = "the checkpoint") -> None:
    """Refuse the bias ``key`` of an FP8 layer stored as fp8 codes or integers (``source``:
    the file it came from). It is added in the compute dtype and has no scale: fp8 codes would
    be added as plain numbers, and the layer would compute in fp8."""
    if is_bias_dtype(dtype):
        return
    raise CheckpointTensorError(
        f"{key}: the bias of an FP8 layer must be stored as a high-precision float "
        f"(float32, bfloat16 or float16), found {str(dtype).removeprefix('torch.')} in "
        f"{source}. hf_fp8 never writes such a bias (it has no scale, and the layer would "
        "compute in fp8): re-export the checkpoint from its high-precision model with "
        "hf_fp8 (save_pretrained or hf_fp8.export)"
    )


class ScaleBatch:
    """Scales whose values are checked together after their dtypes and shapes: one fused
    test per (bound, device) group, per-tensor checks (and their named errors) only when a
    group fails. A load checks every layer's scales; one op each would cost ~30 µs a layer."""

    def __init__(self) -> None:
        self.groups: dict[tuple[float, float, torch.device], list[tuple[str, torch.Tensor]]] = {}

    def add(
        self, name: str, t: torch.Tensor, shape: tuple[int, ...], bound: float, low: float = 0.0
    ) -> None:
        """``low``: the smallest accepted value (static input scales: ``min_input_scale``);
        0 for weight scales, which only need to be > 0."""
        check_scale_tensor(name, t, shape=shape, max_value=bound, check_values=False)
        if not t.is_meta and t.numel():
            self.groups.setdefault((low, bound, t.device), []).append((name, t.detach()))

    # elements per fused test: below torch's intra-op grain size, so each test runs on one
    # thread (a parallel op waits for the pool; on a busy machine that took 60 ms, not 2)
    CHUNK = 32768

    def check(self) -> None:
        for (low, bound, _), items in self.groups.items():
            for chunk in self._chunks(items):
                flat = torch.cat([t.reshape(-1) for _, t in chunk])
                ok = (flat >= low) & (flat <= bound) if low else (flat > 0) & (flat <= bound)
                if not bool(ok.all()):  # NaN fails both
                    for name, t in chunk:
                        check_scale_tensor(name, t, max_value=bound, min_value=low or None)

    def _chunks(self, items: list[tuple[str, torch.Tensor]]):
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for item in items:
            if chunk and size + item[1].numel() > self.CHUNK:
                yield chunk
                chunk, size = [], 0
            chunk.append(item)
            size += item[1].numel()
        if chunk:
            yield chunk


def check_fp8_linear(
    name: str, module: Fp8Linear, *, check_values: bool = True, scales: ScaleBatch | None = None
) -> None:
    """Check one loaded ``Fp8Linear``: fp8 weight, weight scale and static input scale.

    ``name`` is the module's name in the model (the checkpoint keys are ``name.weight``...).
    ``scales``: add the scale values to this batch instead of checking them now.
    """
    batch = ScaleBatch() if scales is None else scales
    dtype = fp8_dtype(module.fp8_format)
    bound = max_scale(dtype, module.compute_dtype)
    check_fp8_tensor(
        f"{name}.weight",
        module.weight,
        dtype=dtype,
        shape=(module.out_features, module.in_features),
        check_values=check_values,
    )
    scale_shape = weight_scale_shape(
        module.out_features, module.in_features, module.weight_granularity, module.block_size
    )
    batch.add(f"{name}.weight_scale", module.weight_scale, scale_shape, bound)
    if module.bias is not None:
        check_bias(f"{name}.bias", module.bias.dtype)
    if module.input_scale is not None:
        batch.add(f"{name}.input_scale", module.input_scale, (1,), bound, min_input_scale(dtype))
    if scales is None:
        batch.check()


def check_fp8_experts(
    name: str, module: Fp8Experts, *, check_values: bool = True, scales: ScaleBatch | None = None
) -> None:
    """Check one loaded ``Fp8Experts``: per projection ``[E, out, in]`` fp8 codes, per-expert
    weight scales and (static) ``[E]`` input scales."""
    batch = ScaleBatch() if scales is None else scales
    dtype = fp8_dtype(module.fp8_format)
    bound = max_scale(dtype, module.compute_dtype)
    for proj in module.layout.projections:
        e, n, k = module.layout.shape(proj)
        check_fp8_tensor(
            f"{name}.{proj}",
            getattr(module, proj),
            dtype=dtype,
            shape=(e, n, k),
            check_values=check_values,
        )
        scale_shape = weight_scale_shape(n, k, module.weight_granularity, module.block_size)
        batch.add(
            f"{name}.{proj}_weight_scale",
            getattr(module, f"{proj}_weight_scale"),
            (e, *scale_shape),
            bound,
        )
        bias = getattr(module, f"{proj}_bias", None)
        if bias is not None:
            check_bias(f"{name}.{proj}_bias", bias.dtype)
        input_scale = getattr(module, f"{proj}_input_scale")
        if input_scale is not None:
            low = min_input_scale(dtype)
            batch.add(f"{name}.{proj}_input_scale", input_scale, (e,), bound, low)
    if scales is None:
        batch.check()


def _check_stray(
    name: str, module: nn.Module, skipped: Iterable[str], model: nn.Module | None = None
) -> None:
    for pname, tensor in (
        *module.named_parameters(recurse=False),
        *module.named_buffers(recurse=False),
    ):
        if tensor is not None and is_fp8(tensor.dtype):
            key = f"{name}.{pname}" if name else pname
            skip = sorted(skipped)
            rule = parent = None
            if model is not None and not matches_module(name, skip):
                parent = _parent(model, name)
                rule = keep_reason(module, name, parent=parent)
            settings = opening_settings(parent, name.rpartition(".")[2]) if parent else ()
            if (rule or "").endswith("reads its .weight directly") and settings:  # not the class
                child = name.rpartition(".")[2]
                conditions, values = describe_settings(parent, settings)
                raise CheckpointTensorError(
                    f"{key}: is FP8 on disk ({tensor.dtype}), but {name} stays in high "
                    f"precision on this model: {type(parent).__name__} reads {child}.weight "
                    f"when {conditions} (here {values}), and the FP8 layer would fail or "
                    f"compute wrong there. The checkpoint was saved with that branch closed "
                    f"({child} converted): load it with the setting(s) it was saved with (e.g. "
                    f"from_pretrained(..., {closing_hint(settings)}) when the model's config "
                    "holds it), or quantize the high-precision model with these settings"
                )
            if rule is not None and rule != "not a linear":
                raise CheckpointTensorError(
                    f"{key}: is FP8 on disk ({tensor.dtype}), but hf_fp8 keeps {name} in high "
                    f"precision ({rule}): the FP8 layer would fail or compute wrong there. The "
                    "checkpoint was written by an hf_fp8 that converted it; re-export it from "
                    "the high-precision model with this version (save_pretrained)"
                )
            raise CheckpointTensorError(
                f"{key}: is FP8 on disk ({tensor.dtype}), but {name or 'the model'} loads "
                f"as {type(module).__name__}, which would read the fp8 codes as plain "
                "numbers without their scales. The checkpoint's config.json lists it in "
                f"quantization_config.modules_to_not_convert ({skip}): that list must name "
                "only layers stored in high precision; remove this one from it"
            )


def _parent(model: nn.Module, name: str) -> nn.Module | None:
    if not name:
        return None
    parent = name.rpartition(".")[0]
    return model.get_submodule(parent) if parent else model


def check_no_stray_fp8(model: nn.Module, skipped: Iterable[str] = ()) -> None:
    """Raise if a module other than ``Fp8Linear`` / ``Fp8Experts`` holds fp8 codes (which
    it would read as plain numbers)."""
    for name, module in model.named_modules():
        if not isinstance(module, (Fp8Linear, Fp8Experts)):
            _check_stray(name, module, skipped, model)


def _warn_degenerate_input_scales(static: list[tuple[str, torch.Tensor, float]]) -> None:
    """One warning naming static layers whose input scale is that of an all-zero amax.

    ``AMAX_EPS / fp8_max`` is what calibration stored for a layer that saw only zeros
    (before calibrate learnt to fall back): such a layer saturates every nonzero input.
    """
    if not static:
        return
    values = torch.cat([s.detach().reshape(-1)[:1].cpu() for _, s, _ in static])
    limits = torch.tensor([limit * (1 + 1e-3) for _, _, limit in static])
    tiny = [static[i][0] for i in torch.nonzero(values <= limits).flatten().tolist()]
    if tiny:
        shown = ", ".join(tiny[:8]) + (f" and {len(tiny) - 8} more" if len(tiny) > 8 else "")
        warnings.warn(
            f"{len(tiny)} static layer(s) have the input_scale of an all-zero calibration "
            f"(amax {AMAX_EPS:g}): {shown}. They saturate every nonzero input; re-calibrate "
            "with hf_fp8.calibrate (which now falls back to a usable scale) and save again",
            UserWarning,
            stacklevel=3,
        )


def check_codes_default() -> bool:
    """``HF_FP8_CHECK_CODES=1``: also scan every fp8 weight byte for NaN / inf codes at load."""
    return os.environ.get("HF_FP8_CHECK_CODES", "0").strip().lower() in ("1", "true", "yes")


def validate_loaded_model(
    model: nn.Module, *, skipped: Iterable[str] = (), check_codes: bool | None = None
) -> None:
    """Check every ``Fp8Linear`` / ``Fp8Experts`` and every stray fp8 tensor after loading.

    Dtypes, shapes and every scale value are always checked (one walk, the scale values in
    one fused test). ``check_codes`` (default: :func:`check_codes_default`) also scans the
    fp8 weight bytes for NaN / inf codes: a full pass over every weight, which turns
    safetensors' lazy mapping into a read (about the cost of copying the weights once), for
    corruption hf_fp8 itself never writes. Disk-offloaded tensors stay on meta: their
    dtypes and shapes are checked here, their values while loading (``check_stored_tensor``).
    Warns once about static input scales left by an all-zero calibration.
    """
    codes = check_codes_default() if check_codes is None else check_codes
    scales = ScaleBatch()
    static: list[tuple[str, torch.Tensor, float]] = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            check_fp8_linear(name, module, check_values=codes, scales=scales)
            scale = module.input_scale
            if scale is not None and not scale.is_meta:
                static.append((name, scale, AMAX_EPS / fp8_max(fp8_dtype(module.fp8_format))))
        elif isinstance(module, Fp8Experts):
            check_fp8_experts(name, module, check_values=codes, scales=scales)
        else:
            _check_stray(name, module, skipped, model)
    scales.check()
    _warn_degenerate_input_scales(static)
