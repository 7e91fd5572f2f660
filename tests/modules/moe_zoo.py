"""Every experts class of the installed transformers, built tiny from its own config class.

Discovery reads the library, not a list of names: a modeling module whose source uses
``@use_experts_implementation`` is imported, and a class counts when its ``__init__`` is the
decorator's wrapper. Each class is built from the default config of its model (or the text
sub-config) with the sizes that experts read shrunk to a few units.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import warnings
from pathlib import Path

import torch
import transformers
from torch import nn

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 6, 2
_SHRINK = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "moe_hidden_size": HIDDEN,  # MuseSpark pools hidden_size down to this before its experts
    "intermediate_size": INTER,
    "moe_intermediate_size": INTER,
    "expert_intermediate_size": INTER,
    "moe_ffn_hidden_size": INTER,
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_topk": TOP_K,
}


def _decorated(cls: type) -> bool:
    init = cls.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    return code is not None and "original_init" in code.co_freevars and hasattr(init, "__wrapped__")


@functools.cache
def experts_classes() -> tuple[type, ...]:
    """Every class decorated with ``use_experts_implementation`` in transformers.models."""
    root = Path(transformers.models.__file__).parent
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        if "@use_experts_implementation" not in path.read_text(encoding="utf-8"):
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, nn.Module)
                and value.__module__ == module.__name__
                and _decorated(value)
            ):
                found.append(value)
    return tuple(found)


def _shrink(config: transformers.PretrainedConfig) -> None:
    for key, value in _SHRINK.items():
        try:
            current = getattr(config, key)
        except Exception:  # e.g. per-layer attributes of heterogeneous configs
            continue
        if isinstance(current, list):
            value = [value] * len(current)
        if current is None or isinstance(current, (int, list)):
            with contextlib.suppress(Exception):
                setattr(config, key, value)


def _candidate_configs(cls: type) -> list[transformers.PretrainedConfig]:
    name = cls.__module__.replace(".modeling_", ".configuration_")
    module = importlib.import_module(name)
    configs = []
    for value in vars(module).values():
        if (
            inspect.isclass(value)
            and issubclass(value, transformers.PretrainedConfig)
            and value.__module__ == module.__name__
        ):
            try:
                config = value()
            except Exception:
                continue
            configs.append(config)
            text = getattr(config, "text_config", None)
            if isinstance(text, transformers.PretrainedConfig):
                configs.append(text)
    # text configs first: multimodal families build their experts from them
    return sorted(configs, key=lambda c: "Text" not in type(c).__name__)


def _size_kwargs(cls: type) -> dict[str, int]:
    """Shrunk values for the size arguments an ``__init__`` takes besides ``config``
    (Ernie-4.5-VL passes each modality's ``intermediate_size``)."""
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    params = list(inspect.signature(init).parameters)[2:]
    return {name: _SHRINK[name] for name in params if name in _SHRINK}


def build_tiny(cls: type, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialised, tiny instance of the experts class ``cls`` (eager forward);
    a fresh copy on every call (built once per class and seed)."""
    return copy.deepcopy(_build_tiny(cls, seed)).to(dtype)


@functools.cache
def _build_tiny(cls: type, seed: int) -> nn.Module:
    errors = []
    kwargs = _size_kwargs(cls)
    for config in _candidate_configs(cls):
        _shrink(config)
        if hasattr(config, "enable_moe_block"):
            config.enable_moe_block = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.device("meta"):
                    probe = cls(config, **kwargs)
            if sum(p.numel() for p in probe.parameters()) > 2_000_000:
                errors.append(f"{type(config).__name__}: not tiny")
                continue
            module = cls(config, **kwargs)
        except Exception as err:  # try the next config of the family
            errors.append(f"{type(config).__name__}: {err}")
            continue
        config._experts_implementation = "eager"
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        return module
    raise RuntimeError(f"could not build {cls.__name__}: {errors}")


def routed_inputs(
    hidden: int, num_experts: int, tokens: int = 9, top_k: int = TOP_K, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, distinct top-k expert ids per token and softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, index, weights
