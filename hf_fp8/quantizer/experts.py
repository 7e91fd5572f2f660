"""The quantizer's part for MoE experts (``Fp8Experts``): swap before loading, quantize the
merged checkpoint tensors on the fly, finish after loading, dequantize.

transformers merges a checkpoint's per-expert tensors (``experts.N.gate_proj.weight`` ...)
into the fused ``[E, ...]`` parameters with its conversion mapping (``MergeModulelist``,
``Concatenate``) *before* a quantizer's op runs, so :func:`quantize_experts_tensor` receives
the merged tensor under the target key (``...experts.gate_up_proj``) in the source layout and
returns the fp8 codes and ``{proj}_weight_scale``. Pre-quantized checkpoints store those
names as they are; ``save_pretrained`` splits the codes back per expert with the reverse of
the mapping and keeps the scale names fused, which the next load merges back bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hf_fp8.modules.experts_kinds import convertible_outside_experts
from hf_fp8.modules.fp8_experts import Fp8Experts, convertible_experts
from hf_fp8.modules.replace import shared_scale
from hf_fp8.numerics import is_fp8
from hf_fp8.quantizer.validation import check_bias, checkpoint_file, is_bias_dtype

EXPERTS_SCALE_SUFFIXES = ("_weight_scale", "_input_scale")
# the instance attribute holding a shared module's config input scales, by projection
SHARED_SCALES = "_hf_fp8_shared_input_scales"


def experts_to_convert(
    model: nn.Module,
    *,
    skip: Sequence[str] = (),
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> list[tuple[str, nn.Module, nn.Module, type[Fp8Experts]]]:
    """``(name, module, parent, fp8_class)`` of every experts module of ``model`` that
    converts: ``Fp8Experts`` for transformers' experts interface, ``Fp8BmmExperts`` /
    ``Fp8ParallelExperts`` for the kinds outside it (Llama-4, JetMoE:
    ``hf_fp8.modules.experts_kinds``). Every class has ``from_experts`` / ``empty_like``."""
    found = [
        (n, m, p, Fp8Experts)
        for n, m, p in convertible_experts(model, skip=skip, module_filter_fn=module_filter_fn)
    ]
    return found + convertible_outside_experts(model, skip=skip, module_filter_fn=module_filter_fn)


def swap_experts(
    model: nn.Module, config: Any, *, skip: Sequence[str] = (), pre_quantized: bool
) -> dict[str, Fp8Experts]:
    """Replace every convertible experts module of ``model`` (on meta) by empty
    ``Fp8Experts`` storage; return them by name. A pre-quantized static checkpoint gets
    room for its ``[E]`` input scales. An experts module shared by several parents is
    swapped once and stays shared; the config's input scale for each projection is the
    entry under any of its names (``hf_fp8.modules.replace.shared_scale``: different
    entries are refused here, before loading), applied by :func:`finish_experts`."""
    swapped: dict[int, Fp8Experts] = {}
    out: dict[str, Fp8Experts] = {}
    names: dict[int, list[str]] = {}  # a module shared by two parents: its names
    for name, module, parent, cls in experts_to_convert(model, skip=skip):
        names.setdefault(id(module), []).append(name)
        new = swapped.get(id(module))
        if new is None:
            new = cls.empty_like(module, config, module_name=name, device="meta")
            if not pre_quantized:
                # input scales given in the config are set after loading (finish_experts):
                # here transformers would report them "MISSING ... newly initialized"
                for proj in new.layout.projections:
                    setattr(new, f"{proj}_input_scale", None)
            elif new.recipe.is_static:
                for proj in new.layout.projections:
                    if getattr(new, f"{proj}_input_scale") is None:
                        new.set_input_scale(
                            proj, torch.empty(new.num_experts, dtype=torch.float32, device="meta")
                        )
            new.__dict__["fp8_name"] = name
            new._is_hf_initialized = True
            swapped[id(module)] = new
        setattr(parent, name.rpartition(".")[2], new)
        out[name] = new
    for key, found in names.items():
        if len(found) > 1 and swapped[key].recipe.is_static:
            # one input scale per projection: the config's entry under any of its names,
            # entries that differ refused before anything loads (as quantize_model, R27 F3)
            swapped[key].__dict__[SHARED_SCALES] = {
                proj: shared_scale(config, [f"{n}.{proj}" for n in found])
                for proj in swapped[key].layout.projections
            }
    return out


def experts_tensor_names(name: str, module: Fp8Experts) -> list[str]:
    """Checkpoint keys of every fp8 tensor and scale of one ``Fp8Experts``."""
    return [
        f"{name}.{proj}{suffix}"
        for proj in module.layout.projections
        for suffix in ("", *EXPERTS_SCALE_SUFFIXES)
    ]


def is_experts_weight(module: nn.Module, tensor_name: str) -> bool:
    """``tensor_name`` is an expert projection of an ``Fp8Experts`` (what on-the-fly
    quantization replaces)."""
    return isinstance(module, Fp8Experts) and tensor_name in module.layout.projections


def is_experts_scale(module: nn.Module, tensor_name: str) -> bool:
    return isinstance(module, Fp8Experts) and tensor_name.endswith(EXPERTS_SCALE_SUFFIXES)


def quantize_experts_tensor(
    key: str, weight: torch.Tensor, module: Fp8Experts
) -> dict[str, torch.Tensor]:
    """``{key: fp8 codes [E, out, in], key_weight_scale: scales}`` for one merged
    high-precision projection ``weight`` (source layout) of ``module``."""
    from hf_fp8.modules.fp8_experts import quantize_projection

    if is_fp8(weight.dtype):
        raise ValueError(f"{key}: already fp8; it cannot be quantized again")
    codes, scales = quantize_projection(weight, module.layout, module.recipe, name=key)
    return {key: codes.contiguous(), f"{key}_weight_scale": scales}


def finish_experts(
    name: str,
    module: Fp8Experts,
    config: Any,
    *,
    offloaded: bool,
    checkpoint_root: str = "",
    scale_for: Callable[[str], float | None] | None = None,
    filled: list[str] | None = None,
    kept: list[str] | None = None,
) -> list[str]:
    """After loading: the names of tensors the checkpoint did not fill; static input scales
    the checkpoint lacks (saved before calibration; a checkpoint that stores only some is
    refused by the quantizer, ``StoredInputScales``) dropped, or taken from ``config``
    (``Fp8Config.activation_scale_for``); codes and scales frozen; compute dtype from the bias
    (an fp8 or integer bias refused, naming its file in ``checkpoint_root``). ``scale_for``
    (``"<name>.<proj>"`` -> scale) replaces ``config.activation_scale_for``: the scales passed
    to ``from_pretrained`` for a static checkpoint (R42 F2); the module's name is appended to
    ``filled`` when one filled a missing input scale, to ``kept`` when a stored one stays."""
    missing = []
    shared = module.__dict__.pop(SHARED_SCALES, None)  # set by swap_experts
    for proj in module.layout.projections:
        for pname in (proj, f"{proj}_weight_scale", f"{proj}_bias"):
            p = getattr(module, pname)
            if p is not None and not (offloaded or getattr(p, "_is_hf_initialized", False)):
                missing.append(f"{name}.{pname}")
        key = f"{proj}_input_scale"
        scale = getattr(module, key)
        if scale is not None and not (offloaded or getattr(scale, "_is_hf_initialized", False)):
            setattr(module, key, None)
        scale_of = scale_for or config.activation_scale_for
        given = scale_of(f"{name}.{proj}") if module.recipe.is_static else None
        if shared is not None:  # a module shared under several names: under any of them
            given = shared[proj]
        if given is not None and getattr(module, key) is None:
            module.set_input_scale(proj, given)
            if filled is not None and name not in filled:
                filled.append(name)
        elif given is not None and not offloaded and kept is not None and name not in kept:
            kept.append(name)
        for pname in (proj, f"{proj}_weight_scale", key):
            p = getattr(module, pname)
            if p is not None:
                p.requires_grad_(False)
        bias = getattr(module, f"{proj}_bias")
        if bias is not None:  # never an fp8 compute dtype
            key = f"{name}.{proj}_bias"
            if not is_bias_dtype(bias.dtype):  # the file is looked up only for the error
                check_bias(key, bias.dtype, source=checkpoint_file(checkpoint_root, key))
            module.compute_dtype = bias.dtype
    return missing


def dequantize_experts(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every ``Fp8Experts`` of ``model`` by its source class in high precision;
    return how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Experts):
            parent_name, _, child = name.rpartition(".")
            new = module.dequantize()
            if dtype is not None:
                new = new.to(dtype)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
            count += 1
    return count
