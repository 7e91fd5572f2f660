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
:func:`check_trainable_copy` before peft builds any of them (``get_peft_model``,
``add_adapter``, ``PeftModel.from_pretrained``).
High-precision modules (``lm_head`` and classifier heads are kept so by default) are untouched.
"""

from __future__ import annotations

from torch import nn

from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear

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


def check_trainable_copy(what: str, module: nn.Module) -> None:
    """Raise ``ValueError`` when peft's ``what`` (``"modules_to_save"``,
    ``"trainable_token_indices"``, ...) targets ``module`` and it is, or holds, an FP8 layer."""
    parts = fp8_parts(module)
    if not parts:
        return
    name = _full_name(parts)
    short = name.rpartition(".")[2] or "<its name>"
    kinds = sorted({type(m).__name__ for _, m in parts})
    if parts[0][0] == "":
        target = f"{name + ', ' if name else ''}an FP8 layer ({kinds[0]})"
    else:
        held = ", ".join(rel for rel, _ in parts[:4]) + (", ..." if len(parts) > 4 else "")
        kind = ", ".join(kinds)
        target = f"{name or type(module).__name__}, which holds FP8 layers ({held}: {kind})"
    if any(isinstance(m, Fp8Experts) for _, m in parts):
        lora = (
            "or train LoRA adapters on the attention and dense layers instead "
            "(LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']))"
        )
    else:  # LoRA on the FP8 linears themselves (a block is no LoRA target)
        leaves = list(dict.fromkeys(rel.rpartition(".")[2] or short for rel, _ in parts))
        lora = f"or train LoRA adapters on it instead: LoraConfig(target_modules={leaves!r})"
    raise ValueError(
        f"peft {what} names {target}: {_WHAT_PEFT_DOES.get(what, 'peft would train it')}. "
        f"Keep it in high precision to train it fully: load with hf_fp8.Fp8Config(..., "
        f"modules_to_not_convert=[{short!r}]) or quantize with hf_fp8.quantize_model(model, "
        f"config, skip=[{short!r}]); {lora}, and drop it from {what}."
    )
