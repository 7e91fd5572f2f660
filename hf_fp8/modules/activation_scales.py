"""The keys of ``Fp8Config(activation_scales={...})`` checked against the model, once per swap.

A key is the full name of a converted linear (``"model.layers.0.self_attn.q_proj"``) or, for MoE
experts, ``"<experts module>.<projection>"`` (``"model.layers.0.mlp.experts.down_proj"``); each
layer reads its key with ``Fp8Config.activation_scale_for`` and falls back to
``activation_scale``. A key that names no module (a typo) would leave its layer silently on the
fallback scale: :func:`check_activation_scales` refuses it, naming close matches. A key that
names a module the swap leaves as it is (kept in high precision, or FP8 already) is only
warned about: that layer needs no static scale.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping

from torch import nn

from hf_fp8.modules.experts_kinds import OUTSIDE_INTERFACE
from hf_fp8.modules.fp8_experts import Fp8Experts, experts_layout
from hf_fp8.modules.fp8_linear import Fp8Linear

__all__ = ["check_activation_scales", "scale_keys"]


def scale_keys(name: str, module: nn.Module) -> tuple[str, ...]:
    """The ``activation_scales`` keys that ``module`` (called ``name``) reads once converted:
    ``name`` for a linear, ``name.<projection>`` for each projection of an experts module
    (high precision or FP8 already)."""
    layout = experts_layout(module)  # Fp8Experts (all kinds) or the experts interface
    for layout_of, _ in OUTSIDE_INTERFACE if layout is None else ():
        layout = layout_of(module)  # Llama-4 bmm / JetMoE parallel experts
        if layout is not None:
            break
    if layout is None:
        return (name,)
    return tuple(f"{name}.{proj}" for proj in layout.projections)


def _fp8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, (Fp8Linear, Fp8Experts))
    ]


def check_activation_scales(
    model: nn.Module,
    scales: Mapping[str, float] | None,
    converted: Iterable[tuple[str, nn.Module]] | None = None,
) -> None:
    """Refuse ``activation_scales`` keys that name nothing in ``model``; warn about keys that
    name a module the swap does not convert. Call once per model, at the swap.

    ``converted``: ``(name, module)`` of every layer the swap converts (before the swap: the
    high-precision linears and experts); ``None`` reads the FP8 modules of ``model`` (after
    the swap). Raises ``ValueError`` naming the unmatched keys and close matches.
    """
    if not scales:
        return
    pairs = _fp8_modules(model) if converted is None else converted
    used = {key for name, module in pairs for key in scale_keys(name, module)}
    unused = [key for key in scales if key not in used]
    if not unused:
        return
    converted_names = {name for name, _ in pairs}
    wrong = [key for key in unused if key in converted_names]  # experts: no projection named
    if wrong:
        keys = {name: scale_keys(name, module) for name, module in pairs if name in wrong}
        raise ValueError(
            f"activation_scales key(s) {wrong} name MoE experts modules, which take one scale "
            f"per projection: use the keys {sorted(k for ks in keys.values() for k in ks)} "
            "instead (a key that is not used would silently leave activation_scale)"
        )
    known = set()
    for name, module in model.named_modules(remove_duplicate=False):
        known.update((name, *scale_keys(name, module)))
    unknown = [key for key in unused if key not in known]
    if unknown:
        candidates = sorted(used)
        hints = []
        for key in unknown[:5]:
            close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
            if close:
                hints.append(f"{key!r} -> {close[0]!r}?")
        example = candidates[0] if candidates else "model.layers.0.self_attn.q_proj"
        raise ValueError(
            f"activation_scales key(s) {unknown} name no module of {type(model).__name__}, so "
            "their layers would silently get activation_scale instead"
            + (f" (did you mean: {', '.join(hints)})" if hints else "")
            + ". A key is the full name of a converted linear (e.g. "
            f"{example!r}) or '<experts module>.<projection>' for MoE experts (e.g. "
            "'model.layers.0.mlp.experts.down_proj'): fix or remove these keys"
        )
    warnings.warn(
        f"hf_fp8: activation_scales key(s) {unused} name module(s) of {type(model).__name__} "
        "that are not converted to FP8 here (kept in high precision, or FP8 already), so "
        "these scales are not used",
        UserWarning,
        stacklevel=3,
    )
