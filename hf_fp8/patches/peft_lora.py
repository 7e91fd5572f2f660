"""Patch: every ``LoraConfig`` maps ``Fp8Linear`` to ``Fp8LoraLinear`` (peft's custom modules).

peft 0.21 has a documented (experimental) way to give a layer type its own LoRA layer:
``LoraConfig._register_custom_module({layer_cls: lora_cls})``, checked by peft's dispatcher
before its built-in ones. hf_fp8 calls it at the end of ``LoraConfig.__post_init__`` (so configs
built by ``PeftModel.from_pretrained`` get it too). The mapping is not saved with the adapter
config. A custom module skips peft's built-in dispatch, so ``Fp8LoraLinear`` applies its
``nn.Linear`` rule itself (``fan_in_fan_out`` forced False). Without this patch, LoRA on FP8
layers still trains through peft's default layer, but ``merge_and_unload`` cannot merge into
fp8 weights and DoRA fails.
"""

from __future__ import annotations

import functools
import sys

TRIGGER = "peft.tuners.lora.config"


def register(config) -> None:
    """Register ``Fp8LoraLinear`` for ``Fp8Linear`` targets on one ``LoraConfig``."""
    from hf_fp8.lora import Fp8LoraLinear
    from hf_fp8.modules import Fp8Linear

    custom = getattr(config, "_custom_modules", None) or {}
    if Fp8Linear not in custom:
        config._register_custom_module({Fp8Linear: Fp8LoraLinear})


def applied() -> bool:
    """True when ``LoraConfig.__post_init__`` registers ``Fp8LoraLinear``."""
    config_cls = getattr(sys.modules.get(TRIGGER), "LoraConfig", None)
    return bool(getattr(getattr(config_cls, "__post_init__", None), "_hf_fp8", False))


def apply() -> None:
    """Wrap ``LoraConfig.__post_init__`` once."""
    module = sys.modules.get(TRIGGER)
    if module is None:
        import importlib

        module = importlib.import_module(TRIGGER)
    config_cls = module.LoraConfig
    if not callable(getattr(config_cls, "_register_custom_module", None)):
        raise RuntimeError("peft's LoraConfig._register_custom_module is gone")
    original = config_cls.__post_init__
    if getattr(original, "_hf_fp8", False):
        return

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            register(self)
        except Exception as exc:  # never break LoraConfig()
            from hf_fp8.patches import disable

            disable("peft_lora", f"registering Fp8LoraLinear failed: {exc!r}")

    __post_init__._hf_fp8 = True
    config_cls.__post_init__ = __post_init__


TRIGGERS = {TRIGGER: apply}
