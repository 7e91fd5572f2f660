"""peft's fully trained extra modules on FP8 models: refused on FP8 layers, with the fix.

Besides adapters, peft trains whole modules: ``modules_to_save`` (a trainable copy per adapter,
``ModulesToSaveWrapper``; ``task_type="SEQ_CLS"`` adds the classifier head ``classifier`` /
``score`` itself) and trainable tokens (token rows written into the layer's weight:
``trainable_token_indices`` through ``TrainableTokensWrapper``, or the method of its own,
``TrainableTokensConfig``, through ``TrainableTokensLayer``). On an FP8 layer (``Fp8Linear``,
``Fp8Experts``, or a block that holds one) none can work: the copy's fp8 codes and scales take
no gradient, so it trains nothing (silently once ``freeze_fp8`` is called), an adapter's saved
high-precision copy would load into fp8 codes without its scales, and token rows cannot be
written into fp8 codes. The ``peft_lora`` patch (``hf_fp8.patches.peft_lora``) calls
:func:`check_trainable_copy` for every module peft is about to wrap before peft changes the
model (``hf_fp8.peft_preflight``), and again before peft builds each wrapper
(``get_peft_model``, ``add_adapter``, ``PeftModel.from_pretrained``).

peft's methods other than LoRA (IA3, LoHa, LoKr, AdaLoRA, OFT, BOFT, VeRA, LN-tuning, ...) read
or write the base weight directly, so on FP8 layers they are refused the same way, per target,
by :func:`check_peft_method` (LoRA has ``hf_fp8.lora.Fp8LoraLinear``; BEFT touches only the
high-precision bias and works).
Each refusal says how to keep the layer in high precision for the way the model was made
(``hf_fp8.modules.origin.how_to_keep``: ``modules_to_not_convert`` / ``skip`` when it was
quantized here, a high-precision load and ``quantize_model(..., skip=...)`` for an FP8 checkpoint).
High-precision modules (``lm_head`` and every task head outside ``model.base_model``:
``score``, ``classifier``, ``qa_outputs`` ..., kept so by default) are untouched.
"""

from __future__ import annotations

from torch import nn

from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.origin import how_to_keep

_WHAT_PEFT_DOES = {
    "modules_to_save": "peft would train a full copy of it, but FP8 codes and scales take no "
    "gradient: nothing there would train (silently once freeze_fp8 is called), and a saved "
    "high-precision copy would load into fp8 codes without their scales",
    "trainable_token_indices": "peft would write trained token rows into its fp8 codes, which "
    "take no gradient and have no per-token scale",
}
_WHAT_PEFT_DOES["TrainableTokensConfig target_modules"] = _WHAT_PEFT_DOES["trainable_token_indices"]


def fp8_parts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FP8 modules in ``module`` (itself included, named ``""``), by name relative to it
    (peft's ``base_layer`` steps left out: ``q_proj``, not ``q_proj.base_layer``)."""
    return [
        (".".join(p for p in n.split(".") if p and p != "base_layer"), m)
        for n, m in module.named_modules()
        if isinstance(m, (Fp8Linear, Fp8Experts))
    ]


def _full_name(parts: list[tuple[str, nn.Module]]) -> str:
    """``module``'s name in its model, from the name an FP8 part carries (``fp8_name``)."""
    for rel, part in parts:
        name = part.__dict__.get("fp8_name", "")
        if name and not rel:
            return name
        if name.endswith(f".{rel}"):
            return name[: -len(rel) - 1]
    return ""


def _describe(parts: list[tuple[str, nn.Module]], name: str, module: nn.Module) -> str:
    """``name, an FP8 layer (Fp8Linear)`` or ``name, which holds FP8 layers (...)``."""
    kinds = sorted({type(m).__name__ for _, m in parts})
    if parts[0][0] == "":
        return f"{name + ', ' if name else ''}an FP8 layer ({kinds[0]})"
    held = ", ".join(rel for rel, _ in parts[:4]) + (", ..." if len(parts) > 4 else "")
    return f"{name or type(module).__name__}, which holds FP8 layers ({held}: {', '.join(kinds)})"


def _lora_fix(parts: list[tuple[str, nn.Module]], short: str) -> str:
    """LoRA where hf_fp8 supports it: on the FP8 linears, around FP8 experts."""
    if any(isinstance(m, Fp8Experts) for _, m in parts):
        return (
            "train LoRA adapters on the attention and dense layers instead "
            "(LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']))"
        )
    leaves = list(dict.fromkeys(rel.rpartition(".")[2] or short for rel, _ in parts))
    return f"train LoRA adapters on it instead: LoraConfig(target_modules={leaves!r})"


def check_trainable_copy(what: str, module: nn.Module) -> None:
    """Raise ``ValueError`` when peft's ``what`` (``"modules_to_save"``,
    ``"trainable_token_indices"``, ...) targets ``module`` and it is, or holds, an FP8 layer."""
    parts = fp8_parts(module)
    if not parts:
        return
    name = _full_name(parts)
    short = name.rpartition(".")[2] or "<its name>"
    raise ValueError(
        f"peft {what} names {_describe(parts, name, module)}: "
        f"{_WHAT_PEFT_DOES.get(what, 'peft would train it')}. "
        f"To train it fully, keep it in high precision: {how_to_keep(module, [short])}; "
        f"or {_lora_fix(parts, short)}, and drop it from {what}."
    )


# peft methods (``PeftType`` values) whose layers work on FP8 layers as on high-precision ones:
# LoRA through ``hf_fp8.lora.Fp8LoraLinear``; BEFT trains a bias delta only (forward adds it to
# the FP8 layer's output, merge adds it to its high-precision bias, the fp8 codes are untouched).
FP8_SAFE_METHODS = frozenset({"LORA", "BEFT"})
# ... and those refused elsewhere with their own words (``check_trainable_copy``), or that only
# wrap adapters of a method above (X-LoRA mixes LoRA adapters; its model injects nothing itself)
_CHECKED_ELSEWHERE = frozenset({"TRAINABLE_TOKENS", "XLORA"})

# what was seen of a method on FP8 layers (tests/integration/test_peft_methods.py's docstring)
_ROTATES = "its merge rotates the fp8 codes in place without their scales (silently wrong)"
_ADDS = "its merge adds into the fp8 codes, which fails in peft ('Promotion for Float8 Types')"
_WHAT_METHODS_DO = {
    "OFT": _ROTATES,
    "BOFT": _ROTATES,
    "HRA": "its forward and merge reflect the fp8 codes of the weight as numbers (silently wrong)",
    "LN_TUNING": "it would train a full copy of the module, whose fp8 codes and scales take "
    "no gradient",
    "IA3": "its merge scales the fp8 codes, which fails in peft ('Promotion for Float8 Types')",
    **dict.fromkeys(
        ("LOHA", "LOKR", "ADALORA", "VERA", "FOURIERFT", "MISS", "VBLORA", "GRALORA"), _ADDS
    ),
}


def check_peft_method(config: object, module: nn.Module, key: str) -> None:
    """Raise ``ValueError`` when a peft method other than LoRA (and BEFT) targets ``module``,
    the module ``key`` of the model, and it is, or holds, an FP8 layer.

    peft's other methods read or write ``base_layer.weight`` directly (in their init, forward or
    merge), which on an FP8 layer is fp8 codes without their scales: merges fail in peft (IA3,
    LoHa, LoKr, AdaLoRA, VeRA, ...) or rewrite the codes silently (OFT, BOFT, HRA), and some
    forwards read the codes as numbers. ``hf_fp8.patches.peft_lora`` calls this before peft
    builds each layer (``get_peft_model``, ``add_adapter``, ``PeftModel.from_pretrained``).
    """
    peft_type = getattr(config, "peft_type", None)
    method = str(getattr(peft_type, "value", peft_type))
    if method in FP8_SAFE_METHODS or method in _CHECKED_ELSEWHERE:
        return
    parts = fp8_parts(module)
    if not parts:
        return
    name = key or _full_name(parts)
    short = name.rpartition(".")[2] or "<its name>"
    config_name = type(config).__name__
    why = _WHAT_METHODS_DO.get(
        method,
        "its layers read or write the base weight directly (init, forward or merge), which "
        "here is fp8 codes without their scales",
    )
    raise ValueError(
        f"peft {method} ({config_name}) targets {_describe(parts, name, module)}: hf_fp8 "
        f"supports LoRA (and BEFT) on FP8 linear layers, not {method}: {why}. "
        f"Either {_lora_fix(parts, short)}; or run {method} on a high-precision model (from_pretrained(..., quantization_config="
        f"hf_fp8.Fp8Config(..., dequantize=True)) for an FP8 checkpoint, or no "
        f"quantization_config), merge it (merge_and_unload()) and quantize the merged model "
        f"afterwards with hf_fp8.quantize_model(model, hf_fp8.Fp8Config(...)); or keep this "
        f"layer in high precision: {how_to_keep(module, [short])}."
    )
