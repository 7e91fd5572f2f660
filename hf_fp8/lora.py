"""peft LoRA on FP8 bases: adapters train in the compute dtype; merging gives high precision.

peft 0.21 wraps any ``nn.Linear`` subclass with its default LoRA layer, which trains fine on
an ``Fp8Linear`` (adapters take ``compute_dtype``) but cannot merge: it adds the delta into
``weight.data`` in place, and fp8 tensors do not promote. ``register_peft_lora`` routes
``Fp8Linear`` targets to ``Fp8LoraLinear``, whose ``merge`` swaps the FP8 base for its
dequantized ``nn.Linear`` first. So ``merge_and_unload()`` returns a high-precision model;
``hf_fp8.quantize_model(merged, config)`` turns it back into FP8. ``unmerge`` restores the
original FP8 layer bit for bit.
"""

from __future__ import annotations

import warnings

from hf_fp8.modules import Fp8Linear

try:
    from peft.tuners.lora import LoraModel
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
except ImportError:  # peft is a dependency, but stay importable without it
    LoraModel = None

if LoraModel is not None:

    class Fp8LoraLinear(LoraLinear):
        """peft's LoRA ``Linear`` over an ``Fp8Linear`` base, with a working merge."""

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            base = self.get_base_layer()
            if isinstance(base, Fp8Linear):
                self.__dict__["_fp8_base"] = base  # kept out of the module tree / state dict
                self._set_base(base.dequantize())
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

        def unmerge(self) -> None:
            super().unmerge()
            original = self.__dict__.get("_fp8_base")
            if not self.merged and original is not None:
                self._set_base(original)
                del self.__dict__["_fp8_base"]

        def _set_base(self, layer) -> None:
            owner = self
            while isinstance(owner.base_layer, BaseTunerLayer):
                owner = owner.base_layer
            owner.base_layer = layer


def register_peft_lora() -> bool:
    """Route ``Fp8Linear`` targets of ``get_peft_model`` to ``Fp8LoraLinear`` (idempotent).

    Returns False (with a warning) when peft is missing or its internals changed; LoRA
    training still works then, only ``merge_and_unload`` does not.
    """
    if LoraModel is None:
        return False
    original = getattr(LoraModel, "_create_new_module", None)
    if original is None:
        warnings.warn(
            "hf_fp8: this peft version has no LoraModel._create_new_module; LoRA on FP8 layers "
            "trains, but merge_and_unload() is unsupported. Dequantize first: model.dequantize()",
            stacklevel=2,
        )
        return False
    if getattr(original, "_hf_fp8", False):
        return True

    def create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, Fp8Linear) and kwargs.get("parameter_name") is None:
            return Fp8LoraLinear(target, adapter_name, config=lora_config, **kwargs)
        return original(lora_config, adapter_name, target, **kwargs)

    create_new_module._hf_fp8 = True
    LoraModel._create_new_module = staticmethod(create_new_module)
    return True
