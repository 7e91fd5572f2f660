"""Patch: every ``LoraConfig`` maps ``Fp8Linear`` to ``Fp8LoraLinear`` (peft's custom modules).

peft 0.21 has a documented (experimental) way to give a layer type its own LoRA layer:
``LoraConfig._register_custom_module({layer_cls: lora_cls})``, checked by peft's dispatcher
before its built-in ones. hf_fp8 calls it at the end of ``LoraConfig.__post_init__`` (so configs
built by ``PeftModel.from_pretrained`` get it too). The mapping is not saved with the adapter
config. A custom module skips peft's built-in dispatch, so ``Fp8LoraLinear`` applies its
``nn.Linear`` rule itself (``fan_in_fan_out`` forced False). Without this patch, LoRA on FP8
layers still trains through peft's default layer, but ``merge_and_unload`` cannot merge into
fp8 weights and DoRA fails. ``Fp8Experts`` is mapped to ``hf_fp8.lora.refuse_lora_on_experts``:
LoRA on FP8 experts is refused when ``get_peft_model`` reaches them, with the fix.

It also checks, before peft builds one, every ``AuxiliaryTrainingWrapper`` (``modules_to_save``,
``trainable_token_indices``) and ``TrainableTokensLayer`` (``TrainableTokensConfig``): on an FP8
layer it is refused at ``get_peft_model`` with the fix (``hf_fp8.peft_trainable``), for every
peft method. And it wraps ``BaseTuner.inject_adapter`` so that each target of a method other
than LoRA (and BEFT) is checked before the method builds its layer there: on an FP8 layer it is
refused with the fix (``hf_fp8.peft_trainable.check_peft_method``). If those classes changed,
only the check concerned turns off (one warning); the LoRA registration stays.

On a model holding FP8 layers, that wrapper first runs every one of these refusals on the targets
peft is about to match (``hf_fp8.peft_preflight``: LoRA on FP8 experts, base-rewriting LoRA
inits, other methods, trainable tokens, ``modules_to_save``), so they come before peft changes
the model; and if ``inject_adapter`` fails part-way all the same (a target the early look could
not match, or peft's own error), it puts the model back as it was (``hf_fp8.peft_rollback``:
module tree, attributes, ``requires_grad``, config, the adapter's peft config, and the values a
base-rewriting init such as PiSSA wrote into high-precision targets, kept just before peft built
each layer) before the error propagates.
"""

from __future__ import annotations

import functools
import sys

from torch import nn

TRIGGER = "peft.tuners.lora.config"
WRAPPERS = "peft.utils.other"  # AuxiliaryTrainingWrapper (modules_to_save, trainable tokens)
TOKENS = "peft.tuners.trainable_tokens.layer"  # TrainableTokensLayer (TrainableTokensConfig)
TUNERS = "peft.tuners.tuners_utils"  # BaseTuner.inject_adapter (every method's layers)


def register(config) -> None:
    """Register ``Fp8LoraLinear`` for ``Fp8Linear`` targets on one ``LoraConfig`` (and the
    refusal for ``Fp8Experts`` targets), unless the config maps those types already."""
    from hf_fp8.lora import Fp8LoraLinear, refuse_lora_on_experts
    from hf_fp8.modules import Fp8Experts, Fp8Linear

    custom = getattr(config, "_custom_modules", None) or {}
    mapping = {Fp8Linear: Fp8LoraLinear, Fp8Experts: refuse_lora_on_experts}
    mapping = {k: v for k, v in mapping.items() if k not in custom}
    if mapping:
        config._register_custom_module(mapping)


def applied() -> bool:
    """True when ``LoraConfig.__post_init__`` registers ``Fp8LoraLinear``."""
    config_cls = getattr(sys.modules.get(TRIGGER), "LoraConfig", None)
    return bool(getattr(getattr(config_cls, "__post_init__", None), "_hf_fp8", False))


def _guard_init(cls: type, what: str | None) -> None:
    """Wrap ``cls.__init__`` once: refuse an FP8 first argument (the module peft wraps) before
    peft copies it or reads its weight (``hf_fp8.peft_trainable.check_trainable_copy``)."""
    original = cls.__init__
    if getattr(original, "_hf_fp8", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        module = args[0] if args else kwargs.get("module_to_save", kwargs.get("base_layer"))
        if isinstance(module, nn.Module):
            from hf_fp8.peft_trainable import check_trainable_copy

            # peft's own word for the option ("modules_to_save", "trainable_token_indices")
            name_of = getattr(type(self), "_error_message_name", None)
            option = what or (name_of(self) if callable(name_of) else type(self).__name__)
            check_trainable_copy(option, module)
        original(self, *args, **kwargs)

    __init__._hf_fp8 = True
    cls.__init__ = __init__


def guard_trainable_copies() -> None:
    """Refuse FP8 layers in peft's ``AuxiliaryTrainingWrapper`` (``modules_to_save``,
    ``trainable_token_indices``) now, and in ``TrainableTokensLayer`` (the trainable-tokens
    method) once peft imports it."""
    import importlib

    import _hf_fp8_autoload

    _guard_init(importlib.import_module(WRAPPERS).AuxiliaryTrainingWrapper, None)
    _hf_fp8_autoload.when_imported(TOKENS, _guard_tokens)


def _guard_tokens(module) -> None:
    try:
        _guard_init(module.TrainableTokensLayer, "TrainableTokensConfig target_modules")
    except Exception as exc:
        _partly_off(exc)


def guard_other_methods() -> None:
    """Wrap ``BaseTuner.inject_adapter``: on a model with FP8 layers, every hf_fp8 refusal is
    decided before peft changes the model (``hf_fp8.peft_preflight``); each target of a method
    other than LoRA is checked again (``hf_fp8.peft_trainable.check_peft_method``) before the
    method's own ``_create_and_replace`` builds its layer there; and a failure part-way puts the
    model back as it was (``hf_fp8.peft_rollback``)."""
    import importlib

    tuner_cls = importlib.import_module(TUNERS).BaseTuner
    original = tuner_cls.inject_adapter
    if getattr(original, "_hf_fp8", False):
        return
    if not callable(getattr(tuner_cls, "_create_and_replace", None)):
        raise RuntimeError("peft's BaseTuner._create_and_replace is gone")

    @functools.wraps(original)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        if "_create_and_replace" in self.__dict__:  # an override calling super(): checked once
            return original(self, model, adapter_name, *args, **kwargs)
        from hf_fp8.peft_preflight import check_before_injection, has_fp8
        from hf_fp8.peft_rollback import ModelSnapshot, rewrites_base
        from hf_fp8.peft_trainable import check_peft_method

        if not has_fp8(model):  # nothing hf_fp8 refuses: peft as it is
            return original(self, model, adapter_name, *args, **kwargs)
        try:  # before peft changes anything (peft converts a MoE model's config in place)
            snapshot = ModelSnapshot(model, self, extra=(self.peft_config.get(adapter_name),))
        except Exception:  # never break get_peft_model: only the rollback is lost
            snapshot = None
        try:
            keep_values = snapshot is not None and rewrites_base(self.peft_config[adapter_name])
        except Exception:  # cannot tell: keep the targets' values
            keep_values = snapshot is not None
        create = self._create_and_replace  # the method's own, bound

        def checked(config, adapter_name, target, target_name, parent, *rest, **kw):
            check_peft_method(config, target, kw.get("current_key") or target_name)
            if keep_values:  # the base weight is about to be rewritten (high precision)
                snapshot.keep_values(target)
            return create(config, adapter_name, target, target_name, parent, *rest, **kw)

        try:
            state_dict = kwargs.get("state_dict", args[2] if len(args) > 2 else None)
            config = self.peft_config[adapter_name]
            check_before_injection(self, model, config, adapter_name, state_dict)
            self.__dict__["_create_and_replace"] = checked  # the instance's, for this call only
            try:
                return original(self, model, adapter_name, *args, **kwargs)
            finally:
                del self.__dict__["_create_and_replace"]
        except Exception:
            if snapshot is not None:
                snapshot.restore()  # a refusal (or peft's error) part-way: the model as it was
            raise

    inject_adapter._hf_fp8 = True
    tuner_cls.inject_adapter = inject_adapter


def _partly_off(exc: Exception, what: str = "modules_to_save / trainable tokens") -> None:
    from hf_fp8.patches import disable

    disable(
        "peft_lora",
        f"the check refusing peft {what} on FP8 layers is off: {exc!r}",
        partly=True,
    )


def apply() -> None:
    """Wrap ``AuxiliaryTrainingWrapper.__init__`` and ``LoraConfig.__post_init__`` once."""
    try:
        guard_trainable_copies()
    except Exception as exc:  # the LoRA registration below works without it
        _partly_off(exc)
    try:
        guard_other_methods()
    except Exception as exc:  # as above
        _partly_off(exc, "methods other than LoRA (IA3, LoHa, OFT, ...)")
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
