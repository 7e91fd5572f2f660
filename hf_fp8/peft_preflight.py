"""Every hf_fp8 refusal of a peft configuration, decided before peft changes the model.

peft's ``BaseTuner.inject_adapter`` handles a model in one pass: each matched target in module
order, then ``target_parameters``, then ``modules_to_save`` and trainable tokens
(``set_additional_trainable_modules``), after it froze every base parameter. hf_fp8 refuses what
cannot work on FP8 layers where peft reaches it (``hf_fp8.lora``, ``hf_fp8.peft_trainable``), so a
refusal late in that pass found the targets ahead of it wrapped, a PiSSA init already applied to a
high-precision target, and ``requires_grad`` changed. :func:`check_before_injection` runs the same
checks, in the same order, on the targets peft is about to match (with peft's own matching
helpers, on a copy of the config prepared as peft prepares it: :func:`prepared_config`), before
the pass starts; the ``peft_lora`` patch calls it. The checks where peft reaches
each target stay (a target this early look could not match), and the patch restores the model
when one of them refuses after all (``hf_fp8.peft_rollback``).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.peft_trainable import (
    FP8_SAFE_METHODS,
    check_peft_method,
    check_trainable_copy,
    fp8_parts,
)


def _method(config: Any) -> str:
    peft_type = getattr(config, "peft_type", None)
    return str(getattr(peft_type, "value", peft_type))


def has_fp8(model: nn.Module) -> bool:
    """Whether ``model`` holds an FP8 layer (nothing hf_fp8 refuses can happen without one)."""
    return any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())


def prepared_config(tuner: Any, model: nn.Module, config: Any) -> Any | None:
    """A copy of ``config`` prepared as peft's ``inject_adapter`` prepares it before matching:
    the transformers v4 -> v5 conversion (MoE models: experts named by their old linears, or
    all of them for ``all-linear``, move to ``target_parameters``), the method's default targets
    (``_prepare_adapter_config``) and ``all-linear``. ``config`` itself is not changed (a copy
    with its own containers: peft's conversion writes into ``rank_pattern``). None where peft's
    helpers fail (peft reports its own errors; each target is checked again as peft reaches
    it)."""
    try:
        from peft.tuners import tuners_utils

        config = copy.copy(config)
        for name, value in vars(config).items():  # peft's conversion writes into rank_pattern
            if isinstance(value, (dict, list, set)):
                setattr(config, name, copy.copy(value))
        if tuners_utils.is_transformers_ge_v5 and hasattr(
            getattr(model, "config", None), "model_type"
        ):
            from peft.utils import transformers_weight_conversion as conversion

            mapping = conversion.get_model_conversion_mapping(model)
            conversion.convert_peft_config_for_transformers(config, model, mapping)
        config = tuner._prepare_adapter_config(config, tuner.get_model_config(model))
        return tuners_utils._maybe_include_all_linear_layers(config, model)
    except Exception:  # a best-effort early look; the check at each target stays
        return None


def config_targets(
    tuner: Any, model: nn.Module, prepared: Any | None, state_dict: dict | None = None
) -> list[tuple[str, nn.Module]]:
    """The modules a config targets, in module order, matched as peft's ``inject_adapter`` will
    (the ``prepared`` config and peft's matcher; or the keys of ``state_dict``). Empty where
    peft's helpers fail or ``prepared`` is None."""
    if prepared is None:
        return []
    try:
        from peft.tuners import tuners_utils

        modules = list(model.named_modules())
        wrapped = tuple(k + "." for k, m in modules if isinstance(m, tuners_utils.BaseTunerLayer))
        candidates = [(k, m) for k, m in modules if k and not (wrapped and k.startswith(wrapped))]
        if state_dict is not None:
            prefix = "." + tuners_utils.PEFT_TYPE_TO_PREFIX_MAPPING[prepared.peft_type]
            names = {k.rsplit(prefix, 1)[0].removeprefix("_orig_mod.") for k in state_dict}
            return [(k, m) for k, m in candidates if k.removeprefix("_orig_mod.") in names]
        matched = []
        for key, module in candidates:
            found = tuner._check_target_module_exists(prepared, key)
            if found and not isinstance(found, tuners_utils._ExcludedModule):
                matched.append((key, module))
        return matched
    except Exception:  # a best-effort early look; the check at each target stays
        return []


def _parameter_targets(model: nn.Module, config: Any) -> list[tuple[str, str, nn.Module]]:
    """``(key, parameter name, module)`` for each parameter LoRA's ``target_parameters`` names,
    matched as peft's ``_inject_parameters`` does (``key`` or a ``.``-suffix of it)."""
    names = sorted(set(getattr(config, "target_parameters", None) or []))
    if not names:
        return []
    found = []
    for module_name, module in model.named_modules():
        unwrapped = module_name.replace(".base_layer", "")
        for param_name, _ in module.named_parameters(recurse=False):
            key = f"{unwrapped}.{param_name}"
            if key in names or any(key.endswith(f".{n}") for n in names):
                found.append((key, param_name, module))
    return found


def _pulled_in_note(config: Any, key: str) -> str | None:
    """Why peft targets the experts parameter ``key`` that the user's ``config`` does not name
    in ``target_parameters`` (peft's transformers v5 conversion moved them there), or None."""
    named = set(getattr(config, "target_parameters", None) or [])
    if key in named or any(key.endswith(f".{n}") for n in named):
        return None
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, str) and targets.lower() == "all-linear":
        return (
            "target_modules='all-linear' pulled in the MoE experts (peft targets their fused "
            "3-D weights through target_parameters under transformers 5); list the layers "
            "to adapt instead of 'all-linear'"
        )
    return (
        "target_modules names the MoE experts (peft targets their fused 3-D weights through "
        "target_parameters under transformers 5); leave them out of target_modules"
    )


def _check_lora_target(config: Any, adapter_name: str, key: str, target: nn.Module, **kw) -> None:
    """What ``LoraModel._create_and_replace`` would meet at ``target``: hf_fp8's layer for its
    base type (``config._custom_modules``, the ``peft_lora`` patch) refusing."""
    from peft.tuners.lora.layer import LoraLayer  # (imported by hf_fp8.lora already)
    from peft.tuners.tuners_utils import BaseTunerLayer

    from hf_fp8.lora import Fp8LoraLinear, _check_config, refuse_lora_on_experts

    if isinstance(target, Fp8LoraLinear):  # an adapter added to an existing LoRA layer
        _check_config(config, key)
        return
    if isinstance(target, LoraLayer) and not kw.get("parameter_name"):
        return  # peft's own LoRA layer (built with the patch off): nothing of hf_fp8 runs
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    for base_cls, factory in (getattr(config, "_custom_modules", None) or {}).items():
        if isinstance(base, base_cls):
            if factory is refuse_lora_on_experts:
                refuse_lora_on_experts(base, adapter_name, target_name=key, **kw)
            elif isinstance(factory, type) and issubclass(factory, Fp8LoraLinear):
                _check_config(config, key)
            return


def _trainable_copies(model: nn.Module, config: Any) -> list[tuple[str, str, nn.Module]]:
    """``(option, key, module)`` for each module peft would wrap for ``modules_to_save`` and
    ``trainable_token_indices`` (``_set_trainable``: keys ending with a name), in its order;
    modules already wrapped only get a new adapter (peft checks nothing new there)."""
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # peft moved it: its check at the wrapper is off too (one warning)
        return []
    wanted = []
    if getattr(config, "modules_to_save", None):
        wanted.append(("modules_to_save", list(config.modules_to_save)))
    tokens = getattr(config, "trainable_token_indices", None)
    if tokens is not None:
        if isinstance(tokens, dict):
            names = list(tokens)
        else:
            embedding = model.get_input_embeddings()
            names = [n for n, m in model.named_modules() if m is embedding][:1]
        wanted.append(("trainable_token_indices", names))
    if not wanted:
        return []
    modules = dict(model.named_modules(remove_duplicate=False))
    found = []
    for option, names in wanted:
        for key, module in modules.items():
            if not any(key.endswith(n) for n in names):
                continue
            parent = modules.get(key.rpartition(".")[0])
            grandparent = modules.get(key.rpartition(".")[0].rpartition(".")[0])
            if any(isinstance(m, AuxiliaryTrainingWrapper) for m in (module, grandparent)):
                continue  # peft updates the existing wrapper
            if isinstance(parent, AuxiliaryTrainingWrapper):
                continue
            found.append((option, key, module))
    return found


def check_before_injection(
    tuner: Any, model: nn.Module, config: Any, adapter_name: str, state_dict: dict | None = None
) -> None:
    """Raise the refusal ``config`` would meet while peft injects it into ``model``, before peft
    changes anything, naming the fix: LoRA on FP8 experts and base-rewriting LoRA inits on FP8
    targets (``hf_fp8.lora``), methods other than LoRA and BEFT on FP8 layers, trainable tokens
    and ``modules_to_save`` on FP8 layers (``hf_fp8.peft_trainable``)."""
    if not has_fp8(model):
        return
    method = _method(config)
    prepared = prepared_config(tuner, model, config)
    for key, target in config_targets(tuner, model, prepared, state_dict):
        if method == "LORA":
            _check_lora_target(config, adapter_name, key, target)
        elif method == "TRAINABLE_TOKENS":
            check_trainable_copy("TrainableTokensConfig target_modules", target)
        elif method not in FP8_SAFE_METHODS and fp8_parts(target):
            check_peft_method(config, target, key)
    if method == "LORA" and state_dict is None:
        for key, param_name, module in _parameter_targets(model, prepared or config):
            try:
                _check_lora_target(config, adapter_name, key, module, parameter_name=param_name)
            except NotImplementedError as err:
                pulled_in = _pulled_in_note(config, key)
                if pulled_in is None:
                    raise
                raise NotImplementedError(f"{pulled_in}: {err}") from None
    for option, _, module in _trainable_copies(model, prepared or config):
        check_trainable_copy(option, module)
