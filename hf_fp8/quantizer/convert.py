"""``quantize_model`` for models that are already loaded."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from hf_fp8.config import Fp8Config
from hf_fp8.modules import replace
from hf_fp8.quantizer.hf_quantizer import POST_LOAD_HOOKS, Fp8HfQuantizer


def quantize_model(
    model: nn.Module, config: Fp8Config, *, skip: list[str] | None = None
) -> nn.Module:
    """Replace the ``nn.Linear`` (and GPT-2 ``Conv1D``) layers of ``model`` in place; return it.

    Layers named in ``config.modules_to_not_convert`` or ``skip`` stay in high precision (no
    default skips here: name ``lm_head`` to keep it). A transformers ``PreTrainedModel`` is
    then marked quantized like a ``from_pretrained`` load, so ``save_pretrained`` writes an
    hf_fp8 checkpoint that reloads pre-quantized.
    """
    replace.quantize_model(model, config, skip=skip)
    if isinstance(model, PreTrainedModel):
        kept = sorted(
            name
            for name, m in model.named_modules()
            if type(m) is nn.Linear or replace.is_conv1d(m)
        )
        saved = Fp8Config.from_dict({**config.to_dict(), "modules_to_not_convert": kept})
        quantizer = Fp8HfQuantizer(saved, pre_quantized=True)
        quantizer.modules_to_not_convert = kept
        model.config.quantization_config = saved
        model.hf_quantizer = quantizer
        model.is_quantized = True
        model.quantization_method = saved.quant_method
        for hook in POST_LOAD_HOOKS:
            hook(model, quantizer)
    return model
