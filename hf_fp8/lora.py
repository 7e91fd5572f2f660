"""peft LoRA on FP8 bases: adapters train in the compute dtype; merging gives high precision.

peft 0.21 wraps any ``nn.Linear`` subclass with its default LoRA layer, which trains fine on
an ``Fp8Linear`` (adapters take ``compute_dtype``) but cannot merge: it adds the delta into
``weight.data`` in place, and fp8 tensors do not promote. ``Fp8LoraLinear`` (registered for
``Fp8Linear`` through peft's custom-module API by the ``peft_lora`` patch,
``hf_fp8.patches.peft_lora``) swaps the FP8 base for its dequantized ``nn.Linear`` before
merging. So ``merge_and_unload()`` returns a high-precision model;
``hf_fp8.quantize_model(merged, config)`` turns it back into FP8. ``unmerge`` restores the
original FP8 layer bit for bit.
"""

from __future__ import annotations

from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

from hf_fp8.modules import Fp8Linear


class Fp8LoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` over an ``Fp8Linear`` base, with a working merge."""

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge into a dequantized copy of the FP8 base (which is kept for ``unmerge``)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return  # nothing to merge: the FP8 base stays as it is
        base = self.get_base_layer()
        swapped = isinstance(base, Fp8Linear)
        if swapped:
            self.__dict__["_fp8_base"] = base  # kept out of the module tree / state dict
            self._set_base(base.dequantize())
        try:
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        except BaseException:
            if swapped and not self.merged:
                self._set_base(self.__dict__.pop("_fp8_base"))
            raise

    def unmerge(self) -> None:
        """Unmerge, and put the original FP8 layer back once nothing is merged."""
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
    """Apply the ``peft_lora`` patch now (``import hf_fp8`` does it when peft is imported).

    Returns False, with one warning naming the alternative, when peft's internals changed.
    """
    from hf_fp8.patches import apply

    return apply("peft_lora")
