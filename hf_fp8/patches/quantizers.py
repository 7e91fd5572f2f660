"""Patch: register ``Fp8Config`` / ``Fp8HfQuantizer`` with transformers as ``"hf_fp8"``.

Uses transformers' public ``register_quantization_config`` / ``register_quantizer`` (which
refuse a second registration, hence the checks) and adds ``Fp8Config`` to the private
``LOADING_ATTRIBUTES_CONFIG_TYPES`` tuple, so that ``from_pretrained(fp8_dir,
quantization_config=Fp8Config(dequantize=True))`` overrides the saved loading attributes as it
does for transformers' own FP8. That last part is optional: when the tuple is gone, loading
still works and only the override is off (one warning).
"""

from __future__ import annotations

import sys
from types import ModuleType

import _hf_fp8_autoload

TRIGGER = "transformers.quantizers.auto"
# hf_fp8's quantizer imports transformers.quantizers' HfQuantizer and PreTrainedModel, so the
# registration waits until both the quantizers package and modeling_utils (which imports the
# package half-way through its own execution) have finished importing.
WAIT_FOR = ("transformers.quantizers", "transformers.modeling_utils")


def _auto() -> ModuleType:
    # sys.modules first: this runs while ``transformers.quantizers`` may still be executing
    module = sys.modules.get(TRIGGER)
    if module is None:
        import importlib

        module = importlib.import_module(TRIGGER)
    return module


def apply() -> None:
    """Make ``quant_method="hf_fp8"`` loadable by ``from_pretrained``; safe to call twice."""
    from hf_fp8.config import QUANT_METHOD, Fp8Config
    from hf_fp8.quantizer.hf_quantizer import Fp8HfQuantizer

    auto = _auto()  # before hf_fp8.quantizer: transformers' import order stays its own
    configs, quantizers = auto.AUTO_QUANTIZATION_CONFIG_MAPPING, auto.AUTO_QUANTIZER_MAPPING
    if configs.get(QUANT_METHOD) is not Fp8Config:
        configs.pop(QUANT_METHOD, None)
        auto.register_quantization_config(QUANT_METHOD)(Fp8Config)
    if quantizers.get(QUANT_METHOD) is not Fp8HfQuantizer:
        quantizers.pop(QUANT_METHOD, None)
        auto.register_quantizer(QUANT_METHOD)(Fp8HfQuantizer)
    loading_types = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if not isinstance(loading_types, tuple):
        from hf_fp8.patches import disable

        disable(
            "quantizers",
            "transformers.quantizers.auto.LOADING_ATTRIBUTES_CONFIG_TYPES is gone: "
            "Fp8Config(dequantize=..., kernel=...) passed to from_pretrained of an FP8 "
            "checkpoint does not override the saved config",
            partly=True,
        )
    elif Fp8Config not in loading_types:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*loading_types, Fp8Config)


def applied() -> bool:
    """True when transformers' registry maps ``"hf_fp8"`` to hf_fp8's classes."""
    auto = sys.modules.get(TRIGGER)
    config = sys.modules.get("hf_fp8.config")
    if auto is None or config is None:
        return False
    mapping = getattr(auto, "AUTO_QUANTIZATION_CONFIG_MAPPING", {})
    return mapping.get(config.QUANT_METHOD) is config.Fp8Config


def when_ready() -> None:
    """A trigger finished importing: register, unless another one is still executing (its
    own trigger registers when it finishes)."""
    if not any(_hf_fp8_autoload.importing(name) for name in WAIT_FOR):
        apply()


TRIGGERS = dict.fromkeys(WAIT_FOR, when_ready)
