"""Keep a model's quantization metadata equal to its layers (after a LoRA merge, for instance).

``peft``'s ``merge_and_unload()`` on an FP8 model replaces the merged ``Fp8Linear`` layers by
high-precision ``nn.Linear`` ones (``hf_fp8.lora.Fp8LoraLinear``), but leaves the model's
``config.quantization_config`` and ``hf_quantizer`` as they were. Saved like that, the
checkpoint claims FP8 layers that are not there and ``from_pretrained`` refuses it.
:func:`sync_quantization_state` (run by the save hook of hf_fp8 models) makes the metadata say
what the model is: no FP8 layer left -> a plain high-precision model; some left -> hf_fp8 with
the high-precision linears listed in ``modules_to_not_convert``.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from hf_fp8.config import Fp8Config
from hf_fp8.modules import Fp8Linear, unconverted_linears
from hf_fp8.modules.fp8_experts import Fp8Experts


def sync_quantization_state(model: nn.Module) -> Literal["unchanged", "fp8", "high_precision"]:
    """Make ``model.config.quantization_config`` / ``model.hf_quantizer`` match its layers.

    Returns ``"high_precision"`` when the quantization metadata was removed (no FP8 layer is
    left), ``"fp8"`` when ``modules_to_not_convert`` was updated, else ``"unchanged"``.
    """
    config = getattr(model, "config", None)
    qc = getattr(config, "quantization_config", None)
    if not isinstance(qc, Fp8Config):
        return "unchanged"
    if not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules()):
        del config.quantization_config
        model.hf_quantizer = None
        for name in ("is_quantized", "quantization_method"):
            model.__dict__.pop(name, None)
        return "high_precision"
    kept = unconverted_linears(model)
    if kept == sorted(qc.modules_to_not_convert or []):
        return "unchanged"
    synced = Fp8Config.from_dict({**qc.to_dict(), "modules_to_not_convert": kept})
    config.quantization_config = synced
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.quantization_config = synced
        quantizer.modules_to_not_convert = kept
    return "fp8"
