"""FP8 codes and scales are frozen: no gradient ever reaches them.

``model.requires_grad_(True)`` also flips the flag of the fp8 ``weight`` and its scales, and a
trainable copy of an FP8 layer (peft's ``modules_to_save``, refused at ``get_peft_model`` by
``hf_fp8.peft_trainable``) has them set; a training loop would then run and update nothing
there, silently. FP8 modules call
:func:`check_frozen` in their forward (grad mode only) and raise with the fix instead;
:func:`freeze_fp8` puts the flags back.
"""

from __future__ import annotations

from torch import nn


def _frozen_params(module: nn.Module):
    """The fp8 codes (1-byte parameters) and the scales of one FP8 module."""
    for name, param in module.named_parameters(recurse=False):
        if param.dtype.itemsize == 1 or name.endswith("_scale"):
            yield name, param


def check_frozen(module: nn.Module, names: tuple[str, ...]) -> None:
    """Raise when one of ``module``'s frozen FP8 codes or scales ``names`` asks for a
    gradient (call it in grad mode only: it costs a few attribute reads)."""
    for name in names:
        param = getattr(module, name, None)
        if param is not None and param.requires_grad:
            where = getattr(module, "fp8_name", "") or type(module).__name__
            from hf_fp8.modules.origin import how_to_keep  # (origin imports the FP8 modules)

            leaf = getattr(module, "fp8_name", "").rpartition(".")[2]
            raise RuntimeError(
                f"{where}.{name} has requires_grad=True, but FP8 codes and scales are frozen: "
                "no gradient reaches them, so training would update nothing there. After "
                "model.requires_grad_(True): call hf_fp8.modules.freeze_fp8(model) to train "
                "the other parameters. On a trainable copy of an FP8 layer (peft's "
                "modules_to_save, or a copy made by hand), freeze_fp8 would leave the copy "
                "untrained: train LoRA adapters on it (LoraConfig(target_modules=[...])), or "
                f"keep that layer in high precision: {how_to_keep(module, [leaf] if leaf else None)}"
                ". For a full fine-tune load with Fp8Config(dequantize=True)."
            )


def freeze_fp8(model: nn.Module) -> int:
    """``requires_grad=False`` on every FP8 code and scale of ``model`` (biases, norms and
    adapters keep theirs); returns how many parameters it froze."""
    from hf_fp8.modules.fp8_experts import Fp8Experts
    from hf_fp8.modules.fp8_linear import Fp8Linear

    frozen = 0
    for module in model.modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            for _, param in _frozen_params(module):
                frozen += int(param.requires_grad)
                param.requires_grad_(False)
    return frozen
