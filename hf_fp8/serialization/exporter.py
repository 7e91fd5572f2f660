"""hf_fp8 checkpoint → compressed-tensors or vLLM ``fp8`` checkpoint (``hf_fp8.export``)."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from hf_fp8.config import Fp8Config
from hf_fp8.modules import Fp8Experts, Fp8Linear
from hf_fp8.serialization.checkpoint import (
    CARD_NAME,
    Checkpoint,
    check_out_dir,
    copy_other_files,
    output_folder,
    resolve_checkpoint,
    rewrite_tensors,
    write_config,
)
from hf_fp8.serialization.compressed_tensors import warn_dynamic_granularity
from hf_fp8.serialization.experts import (
    check_split,
    check_splittable,
    expert_modules,
    experts_view,
    has_high_precision_3d,
    high_precision_fused_experts,
    high_precision_fused_tensors,
    ignored_experts,
    split_experts,
    transformers_unfused_experts,
    unfuse_experts,
)
from hf_fp8.serialization.formats import format_of, get_format
from hf_fp8.serialization.layers import LayerPlan, build_meta_model, plan_layers
from hf_fp8.serialization.names import COMPRESSED_TENSORS
from hf_fp8.serialization.tensors import check_complete, compute_dtype_of, to_hf_fp8_tensors
from hf_fp8.serialization.vllm_fused import fused_groups


def hf_fp8_config(checkpoint: Checkpoint) -> Fp8Config:
    """The checkpoint's ``Fp8Config``; raises naming the fix for any other format."""
    fmt = format_of(checkpoint.quantization_config)
    if fmt == "unquantized":
        raise ValueError(
            f"{checkpoint.root} is not quantized: quantize it first "
            "(from_pretrained(..., quantization_config=hf_fp8.Fp8Config(...)) or hf-fp8 quantize)"
        )
    if fmt != "hf_fp8":
        raise ValueError(
            f"{checkpoint.root} is a {fmt} checkpoint, not hf_fp8: import it with "
            "hf_fp8.import_checkpoint (hf-fp8 import) first"
        )
    return Fp8Config.from_dict(checkpoint.quantization_config)


def _from_peft(obj: object) -> bool:
    """A peft model or adapter layer (peft's classes and subclasses such as hf_fp8's
    ``Fp8LoraLinear``); peft is only looked up when something imported it."""
    if type(obj).__module__.split(".")[0] == "peft":
        return True
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    peft = sys.modules.get("peft")
    bases = (getattr(tuners, "BaseTunerLayer", None), getattr(peft, "PeftModel", None))
    return any(isinstance(b, type) and isinstance(obj, b) for b in bases)


_PEFT_FIX = (
    "merge the adapters with merged = model.merge_and_unload() (a high-precision model), "
    "then hf_fp8.quantize_model(merged, Fp8Config(...)) and export that; or export the FP8 "
    "base model without its adapters (model.unload(), or the folder it was loaded from); "
    "save the adapters themselves with model.save_pretrained(folder)"
)


def _check_peft(model: nn.Module) -> None:
    """Refuse a peft model, or a model holding peft adapter layers (``get_base_model()``):
    peft's ``save_pretrained`` writes an adapter, not the model, and the adapters have no place
    in an FP8 checkpoint (R33 F8)."""
    if _from_peft(model):
        raise TypeError(
            f"export got a peft model ({type(model).__name__}): the compressed-tensors and "
            f"vllm-fp8 formats hold a transformers model, not its adapters. To export: {_PEFT_FIX}"
        )
    layers = [name for name, m in model.named_modules() if name and _from_peft(m)]
    if layers:
        shown = ", ".join(layers[:3]) + (
            f" (and {len(layers) - 3} more)" if len(layers) > 3 else ""
        )
        raise TypeError(
            f"export got a model holding peft adapter layers ({shown}): the compressed-tensors "
            f"and vllm-fp8 formats hold a transformers model, not its adapters. To export: "
            f"{_PEFT_FIX}"
        )


def _check_model(model: nn.Module) -> None:
    _check_peft(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"export needs a transformers model or a folder, got {type(model).__name__}"
        )
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    fp8 = any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())  # experts only too
    if not isinstance(qc, Fp8Config) or not fp8:
        raise ValueError(
            "the model is not an hf_fp8 model: load it with "
            "quantization_config=hf_fp8.Fp8Config(...) first"
        )


def check_fused_shards(plan: LayerPlan, fmt_name: str, model_type: object = None) -> None:
    """Refuse a group of sibling linears that vLLM fuses into one layer
    (``serialization.vllm_fused``: Llama's q/k/v, BERT's query/key/value, DeepSeek's MLA
    q_a/kv_a pair, gate/up …) with some members FP8 and others high precision, naming them and
    the fix (R33 F3; other families than Llama's: known gap 13.1)."""
    fp8 = {**dict.fromkeys(plan.high_precision, False), **dict.fromkeys(plan.fp8, True)}
    groups = fused_groups(fp8, model_type)
    mixed = [g for g in groups if len({fp8[m] for m in g.members}) > 1]
    if not mixed:
        return
    group = mixed[0]
    shards = group.kind.shards
    kept = ", ".join(m for m in group.members if not fp8[m])
    quantized = ", ".join(m for m in group.members if fp8[m])
    more = f" (and {len(mixed) - 1} more such group(s))" if len(mixed) > 1 else ""
    names = ", ".join(repr(s) for s in shards)
    fused = group.kind.fused
    raise ValueError(
        f"{fmt_name} export: vLLM fuses {'/'.join(shards)} of one layer into {fused} and needs "
        f"them all FP8 or all high precision, but {kept} is kept in high precision and "
        f"{quantized} is FP8{more}: vLLM refuses this checkpoint (different quantization "
        f"schemes for the shards of {group.fused}). Keep all of them in high precision "
        f"(Fp8Config(..., modules_to_not_convert=[..., {names}])) or none of them, then "
        "quantize and export again; or keep the hf_fp8 checkpoint (from_pretrained loads it)"
    )


def _more(count: int, what: str) -> str:
    return f" (and {count} more {what})" if count else ""


def warn_served_input_scales(
    scales: dict[str, float], plan: LayerPlan, fmt_name: str, model_type: object = None
) -> None:
    """Warn where vLLM serves one static input scale, the largest, for several of the
    model's (R33 F5 / F6): the shards of a fused linear (``vllm_fused.fused_groups``) and the experts
    of a fused-MoE layer, per projection. ``scales``: FP8 module -> its input scale."""
    fused = []
    for group in fused_groups(scales, model_type):
        found = {m: scales[m] for m in group.members}
        if len(set(found.values())) > 1:
            fused.append((group, found))
    if fused:
        group, found = fused[0]
        listed = ", ".join(f"{m} {v:g}" for m, v in found.items())
        largest = max(found.values())
        more = _more(len(fused) - 1, "fused layers")
        warnings.warn(
            f"{fmt_name} export: vLLM fuses {'/'.join(group.kind.shards)} into "
            f"{group.kind.fused} with one static "
            f"input scale, the largest: {listed} are served with {largest:g}{more}, so the "
            f"smaller ones quantize their input up to {largest / min(found.values()):.3g}"
            "x more coarsely in vLLM than in this model. They read the same input: give them "
            "one scale (the same Fp8Config(activation_scales=...) value, or calibrate them)",
            UserWarning,
            stacklevel=4,
        )
    per_layer: dict[tuple[str, str], list[float]] = {}
    for linear, owner in plan.fp8_experts.items():
        if linear in scales:
            per_layer.setdefault((owner, linear.rpartition(".")[2]), []).append(scales[linear])
    differ = [(k, v) for k, v in sorted(per_layer.items()) if len(set(v)) > 1]
    if differ:
        (owner, proj), values = max(differ, key=lambda kv: max(kv[1]) / min(kv[1]))
        more = _more(len(differ) - 1, "experts projections")
        warnings.warn(
            f"{fmt_name} export: the experts of a layer have different static input scales "
            f"(one per expert, as calibrated); vLLM's fused-MoE loader keeps one per layer and "
            f"projection, the largest, for every expert. Most spread: {owner} {proj}: "
            f"{min(values):g} … {max(values):g}, served with {max(values):g}, so some experts "
            f"quantize their input up to {max(values) / min(values):.3g}x more coarsely in "
            f"vLLM than in this model{more}. transformers and hf_fp8 keep the per-expert "
            "scales",
            UserWarning,
            stacklevel=4,
        )


def _high_precision_experts(
    plan: LayerPlan, config: dict, tensors: dict, fmt_name: str
) -> tuple[LayerPlan, dict[str, int]]:
    """``(plan, unfused)``: ``plan`` whose ``ignored()`` also names every MoE layer kept in high
    precision as vLLM matches it (fused experts such as Llama-4's and gpt-oss', and the
    projection names vLLM asks about for experts stored per expert), and the fused experts a
    compressed-tensors export writes one linear per expert (``serialization.experts``)."""
    fused = high_precision_fused_tensors(config.get("model_type"), tensors)
    unfused: dict[str, int] = {}
    if has_high_precision_3d(tensors):  # experts of other shapes: found on the model
        model = build_meta_model(config, tensors)
        fused.update(high_precision_fused_experts(model, tensors, plan.high_precision_experts))
        if fmt_name == COMPRESSED_TENSORS and fused:
            unfused = transformers_unfused_experts(model, fused)
    extra = ignored_experts(plan.high_precision_experts, fused)
    if extra:
        merged = {**extra, **plan.high_precision_experts}
        plan = dataclasses.replace(plan, high_precision_experts=merged)
    return plan, unfused


def export_checkpoint(
    model_or_dir: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "compressed-tensors",
    *,
    overwrite: bool = False,
) -> Path:
    """Write the hf_fp8 model (or checkpoint folder / repo id) ``model_or_dir`` to ``out_dir``
    in ``format`` (``"compressed-tensors"`` or ``"vllm-fp8"``). Tokenizer and other files are
    copied, no model card is written. The output appears whole or not at all; with
    ``overwrite``, files of ``out_dir`` that the export does not write are kept. Returns
    ``out_dir``."""
    with exporting(model_or_dir, out_dir, format, overwrite=overwrite):
        pass
    return Path(out_dir).expanduser()


@contextmanager
def exporting(
    model_or_dir: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "compressed-tensors",
    *,
    overwrite: bool = False,
) -> Iterator[Path]:
    """``export_checkpoint`` that yields the finished temporary folder before it replaces
    ``out_dir``, so that callers can add files (the model card) in the same atomic write."""
    fmt = get_format(format)
    src: Checkpoint | None = None
    if isinstance(model_or_dir, (str, os.PathLike)):
        src = Checkpoint(resolve_checkpoint(model_or_dir))
        hf_fp8_config(src)
        out = check_out_dir(out_dir, source=src.root, overwrite=overwrite)
    else:
        _check_model(model_or_dir)
        out = check_out_dir(out_dir, overwrite=overwrite)
    with output_folder(out) as tmp:
        if src is None:
            model_or_dir.save_pretrained(tmp)
            (tmp / CARD_NAME).unlink(missing_ok=True)  # it describes the hf_fp8 layout
            src = Checkpoint(tmp)
        config = hf_fp8_config(src)
        # MoE experts: written one linear per expert and projection, as vLLM reads them
        tensors, groups = experts_view(src.config.get("model_type"), src.tensors())
        check_splittable(src.config.get("model_type"), src.tensors(), groups)
        check_split(groups, config)
        plan = plan_layers(src.config, tensors, experts=expert_modules(groups))
        check_complete(plan, tensors, config)
        plan, unfused = _high_precision_experts(plan, src.config, tensors, fmt.name)
        model_type = src.config.get("model_type")
        check_fused_shards(plan, fmt.name, model_type)
        quantization_config = fmt.export_config(config, plan)
        if fmt.name == COMPRESSED_TENSORS:
            # here, not in export_config: the model card reads a vLLM warning from
            # export_config as "vLLM refuses it", and vLLM loads this one (other numbers)
            warn_dynamic_granularity(config, fmt.name, stacklevel=4)
        dtype = compute_dtype_of(src.config)

        input_scales: dict[str, float] = {}

        def convert(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            shard = unfuse_experts(split_experts(shard, groups, config), unfused)
            checked = to_hf_fp8_tensors(shard, plan, config, compute_dtype=dtype)
            for name, value in checked.items():
                if name.endswith(".input_scale"):
                    input_scales[name.removesuffix(".input_scale")] = float(value.reshape(-1)[0])
            return fmt.export_tensors(checked, plan, config)

        rewrite_tensors(src, tmp, convert)
        warn_served_input_scales(input_scales, plan, fmt.name, model_type)
        if src.root != tmp.resolve():
            copy_other_files(src, tmp)
        write_config(tmp, {**src.config, "quantization_config": quantization_config})
        yield tmp


def export(
    model_or_dir: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "compressed-tensors",
    *,
    overwrite: bool = False,
    model_card: bool = True,
) -> Path:
    """Write an hf_fp8 model, checkpoint folder or Hub repo id to ``out_dir`` in ``format``
    (``"compressed-tensors"`` — what vLLM, SGLang, TGI and transformers load — or
    ``"vllm-fp8"``), with a ``README.md`` model card (rendered by ``hf_fp8.hub``). Only
    ``out_dir`` is written, all at once; with ``overwrite`` the files of ``out_dir`` that the
    export does not write are kept."""
    base_model = fidelity = None
    if isinstance(model_or_dir, nn.Module):
        state = getattr(model_or_dir, "_hf_fp8_card", None) or {}
        from hf_fp8.hub.card_info import recorded_fidelity  # figures of its compute dtype

        base_model, fidelity = state.get("base_model"), recorded_fidelity(model_or_dir)
    else:
        src = Checkpoint(resolve_checkpoint(model_or_dir))
        model_or_dir = src.root
        previous = _card_info(src.root)
        if previous is not None:
            base_model, fidelity = previous.base_model, previous.fidelity
    out = Path(out_dir).expanduser()
    with exporting(model_or_dir, out, format, overwrite=overwrite) as tmp:
        if model_card:
            _write_card(tmp, out, base_model, fidelity)
    return out


def _card_info(folder: Path):  # -> CardInfo | None
    from hf_fp8.hub.card import read_card_info
    from hf_fp8.hub.card_file import read_card

    text = read_card(folder)  # a link out of the folder, a FIFO, a huge file: refused
    return None if text is None else read_card_info(text)


def _write_card(tmp: Path, out: Path, base_model: str | None, fidelity: dict | None) -> None:
    """The model card of the export, merged with a card ``out`` already has (its tags, and
    its base model for the same model; its fidelity figures never: they describe what the
    export replaces, and the export states what its source recorded)."""
    from hf_fp8.hub.card import merge_card
    from hf_fp8.hub.card_file import read_card
    from hf_fp8.hub.card_info import info_from_summary
    from hf_fp8.serialization.summary import summarize

    info = info_from_summary(summarize(Checkpoint(tmp)), base_model=base_model)
    info.fidelity = dict(fidelity or {})
    existing = read_card(out) if out.is_dir() else None
    text = merge_card(existing, info, carry_figures=False, model_id=out.resolve().name)
    (tmp / CARD_NAME).write_text(text, encoding="utf-8")
