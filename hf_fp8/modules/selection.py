"""The one rule for "is this a layer hf_fp8 converts to ``Fp8Linear``".

Every caller (``quantize_model``, the transformers quantizer, the model card, the serializers)
asks :func:`is_convertible` or walks :func:`convertible_modules`; nobody restates the rule.

A module converts when it is a linear (``nn.Linear``, a subclass that computes a plain linear,
or GPT-2's ``Conv1D``), it is not FP8 already, and none of the named *keep rules* applies:

* ``experts``: MoE experts modules (one module per layer with fused 3-D weights, e.g.
  ``Qwen3MoeExperts``) are not linears: they become ``Fp8Experts``, not ``Fp8Linear``. The
  experts rule is ``hf_fp8.modules.fp8_experts.experts_keep_reason`` (walked by
  ``convertible_experts``): a module built on transformers' ``use_experts_implementation``
  converts; so do two kinds outside it, recognised from their structure
  (``hf_fp8.modules.experts_kinds``): experts that multiply tokens pre-grouped per expert with
  ``bmm`` (``Llama4TextExperts`` -> ``Fp8BmmExperts``) and parallel experts linears
  (``JetMoeParallelExperts`` -> ``Fp8ParallelExperts``); any other (``LongcatFlashExperts``
  with its identity "zero experts", ``DbrxExperts`` …) stays in high precision with
  ``unsupported_reason`` naming what is missing. The quantizer and
  ``quantize_model`` apply both rules.
* ``router``: MoE routers stay in high precision on purpose — they pick the experts each token
  reaches, and a flipped top-k choice costs more than the tiny gemm saves. A router is a linear
  whose class name ends with ``Router`` / ``Gate`` / ``Gating`` (``Llama4Router``,
  ``PhimoeTopKRouter``), a linear inside such a module (``AfmoeTokenChoiceRouter.gate``,
  ``JetMoeTopKGating.layer``), or a linear called ``gate`` / ``router`` /
  ``shared_expert_gate`` whose parent holds ``experts`` (Qwen2-MoE's shared-expert gate).
  Most transformers 5.24 routers (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``,
  ``OlmoeTopKRouter``, ``DeepseekV3TopkRouter``) are plain modules with a ``weight`` parameter,
  not linears, and are never touched anyway.
* ``weight read directly``: ``nn.MultiheadAttention`` passes ``out_proj.weight`` to
  ``F.multi_head_attention_forward`` without calling ``out_proj``, and
  ``nn.TransformerEncoderLayer``'s inference fast path passes ``linear1/2.weight`` to one fused
  op: an FP8 weight there would be multiplied as raw codes. Beyond those two, any parent
  whose methods (its own and inherited, other than ``__init__`` / weight init) read
  ``self.<child>.weight`` anywhere keeps that child, read from the class source with ``ast``:
  Mamba mixers multiply ``dt_proj.weight`` directly on the CPU path and pass ``x_proj`` /
  ``out_proj`` weights to the fused CUDA kernel; T5-style feed-forwards (LongT5,
  SwitchTransformers, Pix2Struct, Kosmos-2.5, NLLB-MoE …) cast their input to
  ``wo.weight.dtype``. Reads under a condition count (the condition may hold on another
  machine), unless the instance's own settings close the branch (Bloom's ``slow_but_exact``
  slices ``dense.weight`` only when that flag is on): ``hf_fp8.modules.weight_reads``.
* ``linear subclass with its own behaviour``: a subclass that overrides ``forward`` (other than
  the known plain ones, e.g. ``FalconLinear``) or holds more than ``weight`` / ``bias``
  (``DoryLMHead``'s logit scale, ``IdeficsDecoupledLinear``'s extra rows).
* ``adapter``: LoRA (peft tuner) adapter weights are trained, not frozen. This rule looks at
  ancestors, so only :func:`convertible_modules` (the model walk) applies it. The *base* of a
  peft layer (``q_proj.base_layer``) is listed like any linear: converting it under peft's own
  layer would skip every FP8 check of ``get_peft_model``, so ``quantize_model`` refuses it,
  named by :func:`inside_peft_layers` (quantize first, then add the adapters).
* ``skip pattern``: a name in ``modules_to_not_convert`` / ``skip`` (see :func:`matches_module`).
* ``module_filter_fn``: a user function ``fn(module, fqn) -> bool`` (as torchao's
  ``module_filter_fn``) that returns ``False``.

:func:`high_precision_parts` names, for a whole model, every parameter that is (or would
stay) high precision and why, grouped: the rules above, plus what is not a linear at all —
embeddings, biases, norms, convolutions (``nn.ConvNd``), and parameters a module uses in
its own forward (XLNet's relative-attention ``q/k/v/o/r``, Zamba's mixer ``x_proj_weight``,
RecurrentGemma's gate weights, Mamba's ``A_log``: ``einsum`` / ``bmm`` / elementwise math on
a parameter, not an ``nn.Linear``; converting them would need that forward rewritten). Read
from the module structure only, no list of model names.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from hf_fp8.modules.experts_kinds import convertible_outside_experts, outside_interface_class
from hf_fp8.modules.fp8_experts import (
    Fp8Experts,
    convertible_experts,
    experts_keep_reason,
    is_experts_module,
)
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.weight_reads import reads_weight_of
from hf_fp8.numerics import is_fp8

ModuleFilter = Callable[[nn.Module, str], bool]

# nn.Linear subclasses whose forward is a plain ``x @ W.T + b`` although they override it.
PLAIN_LINEAR_SUBCLASSES = frozenset({"FalconLinear"})
# Parents that use a child linear's ``.weight`` directly instead of calling the child.
_READS_CHILD_WEIGHT: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,  # its eval fast path passes linear1/2.weight to a fused op
)
_ROUTER_CLASS_SUFFIXES = ("router", "gate", "gating")
_ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})


def matches_module(name: str, patterns: Sequence[str]) -> bool:
    """True when ``name`` is one of ``patterns`` or contains one as dotted components
    (``"lm_head"`` matches ``"lm_head"`` and ``"model.lm_head"``, not ``"lm_head2"``)."""
    dotted = f".{name}."
    return any(name == p or f".{p}." in dotted for p in patterns)


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2 style ``Conv1D`` (transformers.pytorch_utils): a linear with a ``[in, out]`` weight."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_router_class(module: nn.Module | None) -> bool:
    return module is not None and type(module).__name__.lower().endswith(_ROUTER_CLASS_SUFFIXES)


def is_router(module: nn.Module, name: str, parent: nn.Module | None = None) -> bool:
    """The MoE router rule (see the module docstring); ``parent`` enables the parent checks."""
    if _is_router_class(module) or _is_router_class(parent):
        return True
    child = name.rpartition(".")[2]
    return child in _ROUTER_NAMES and parent is not None and hasattr(parent, "experts")


def reads_child_weight(parent: nn.Module | None, child_name: str) -> bool:
    """The weight-read-directly rule: ``parent`` uses ``child_name``'s ``.weight`` itself."""
    if parent is None:
        return False
    if isinstance(parent, _READS_CHILD_WEIGHT):
        return True
    return reads_weight_of(parent, child_name)


def _linear_keep_reason(module: nn.Linear) -> str | None:
    """Why an ``nn.Linear`` (or subclass) is not a plain one ``Fp8Linear`` can replace: its own
    ``forward``, or parameters, buffers or children that the FP8 layer would not carry (they
    would vanish from the model and its state_dict). Whether a buffer or child *exists* is
    what counts, never its value (R31 F4: ``any(module.buffers())`` took a zero one-element
    buffer for none and raised on a vector buffer, e.g. torch's orthogonal parametrization)."""
    cls = type(module)
    name = cls.__name__
    if (
        cls is not nn.Linear
        and cls.forward is not nn.Linear.forward
        and name not in PLAIN_LINEAR_SUBCLASSES
    ):
        return f"{name} is an nn.Linear subclass with its own behaviour"
    extra = sorted({n for n, _ in module.named_parameters(recurse=False)} - {"weight", "bias"})
    extra += [n for n, _ in module.named_buffers(recurse=False)]
    extra += [n for n, _ in module.named_children()]
    if extra:
        held = (
            f"holds {', '.join(repr(n) for n in extra)} besides weight and bias, which "
            "Fp8Linear would not carry"
        )
        if cls is nn.Linear:
            return f"this nn.Linear {held}"
        return f"{name} is an nn.Linear subclass with its own behaviour: it {held}"
    return None


def keep_reason(
    module: nn.Module,
    name: str,
    *,
    parent: nn.Module | None = None,
    skip: Sequence[str] = (),
    module_filter_fn: ModuleFilter | None = None,
) -> str | None:
    """Why ``module`` (called ``name``) stays as it is, or ``None`` when it converts.

    ``parent`` (the module holding it) enables the rules that look at the parent;
    :func:`convertible_modules` always passes it.
    """
    if isinstance(module, (Fp8Linear, Fp8Experts)):
        return "already FP8"
    outside = outside_interface_class(module)  # Llama-4 / JetMoE experts: no interface
    if outside is not None:
        reason = _skip_reason(module, name, skip, module_filter_fn)
        return f"MoE experts: {reason or f'converted by {outside.__name__}'}"
    if is_experts_module(module):
        reason = experts_keep_reason(module, name, skip=skip, module_filter_fn=module_filter_fn)
        return f"MoE experts: {reason or 'converted by Fp8Experts (convertible_experts)'}"
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        return "not a linear"
    if is_router(module, name, parent):
        return "MoE router (kept in high precision on purpose)"
    if isinstance(module, nn.Linear):
        reason = _linear_keep_reason(module)
        if reason is not None:
            return reason
    if reads_child_weight(parent, name.rpartition(".")[2]):
        return f"{type(parent).__name__} reads its .weight directly"
    return _skip_reason(module, name, skip, module_filter_fn)


def _skip_reason(
    module: nn.Module, name: str, skip: Sequence[str], module_filter_fn: ModuleFilter | None
) -> str | None:
    """The user's rules: a ``skip`` pattern or ``module_filter_fn``."""
    if matches_module(name, skip):
        return "named in modules_to_not_convert / skip"
    if module_filter_fn is not None and not module_filter_fn(module, name):
        return "module_filter_fn returned False"
    return None


def is_convertible(
    module: nn.Module,
    name: str,
    *,
    parent: nn.Module | None = None,
    skip: Sequence[str] = (),
    module_filter_fn: ModuleFilter | None = None,
) -> bool:
    """True when hf_fp8 converts ``module`` (called ``name``) to ``Fp8Linear``."""
    return (
        keep_reason(module, name, parent=parent, skip=skip, module_filter_fn=module_filter_fn)
        is None
    )


def _walk(
    module: nn.Module, prefix: str, parent: nn.Module | None, adapter: bool
) -> Iterator[tuple[str, nn.Module, nn.Module | None, bool]]:
    """Every (name, module, parent, inside-an-adapter) occurrence; a module shared by two
    parents is yielded once per parent (so the swap can replace it in both)."""
    yield prefix, module, parent, adapter
    adapter_names = getattr(module, "adapter_layer_names", ())  # peft BaseTunerLayer
    for child_name, child in module.named_children():
        name = f"{prefix}.{child_name}" if prefix else child_name
        yield from _walk(child, name, module, adapter or child_name in adapter_names)


def convertible_modules(
    model: nn.Module,
    *,
    skip: Sequence[str] = (),
    module_filter_fn: ModuleFilter | None = None,
) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, module, parent)`` of every layer of ``model`` that converts, in module order
    (``model`` itself is never returned: it has no parent to swap it in). A layer shared by
    several parents appears once per parent."""
    found = []
    for name, module, parent, adapter in _walk(model, "", None, False):
        if parent is None or adapter:  # LoRA adapters sit in a ModuleDict under the tuner layer
            continue
        if is_convertible(
            module, name, parent=parent, skip=skip, module_filter_fn=module_filter_fn
        ):
            found.append((name, module, parent))
    return found


def is_peft_layer(module: nn.Module) -> bool:
    """True for a peft tuner layer (``BaseTunerLayer``: LoRA, DoRA, IA3, HRA, BOFT ... layers,
    LoRA's ``ParamWrapper`` on experts), whose base layer peft reads and merges itself. peft's
    ``ModulesToSaveWrapper`` is not one: its original module is frozen and converts. Looked up
    without importing peft (a model holding peft layers has imported it)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(tuners, "BaseTunerLayer", None)
    return isinstance(base, type) and isinstance(module, base)


def inside_peft_layers(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """For each of ``names`` (modules of ``model``) inside a peft tuner layer (its base layer,
    or a module in it), the name of the innermost such layer: ``{"...q_proj.base_layer":
    "...q_proj"}``. Adapter children are never converted (:func:`convertible_modules`)."""
    layers = [n for n, m in model.named_modules(remove_duplicate=False) if is_peft_layer(m)]
    if not layers:
        return {}
    found = {}
    for name in names:
        owners = [layer for layer in layers if name.startswith(f"{layer}.")]
        if owners:
            found[name] = max(owners, key=len)
    return found


def task_heads(model: nn.Module) -> list[str]:
    """Names of the linear layers of ``model`` outside its ``base_model`` (transformers' body:
    ``model.model``, ``model.bert`` ...): the task heads (``lm_head``, ``score``,
    ``classifier``, ``classifier.out_proj``, ``qa_outputs`` ...), in module order. ``[]`` when
    ``model`` has no separate base model (``AutoModel``: the body itself, or not a transformers
    model). A module shared with the base model is part of it, and so is a whole transformers
    sub-model held beside it (Kyutai's ``codec_model``, a ``MimiModel``): a body, not a head."""
    base = getattr(model, "base_model", model)
    if base is model or not isinstance(base, nn.Module):
        return []
    bodies = [base]
    bodies += [
        m
        for m in model.modules()
        if m is not model and hasattr(type(m), "base_model_prefix") and hasattr(m, "config")
    ]
    in_base = {id(m) for body in bodies for m in body.modules()}
    return [
        name
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) or is_conv1d(module)) and id(module) not in in_base
    ]


def unmatched_patterns(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The ``patterns`` that match no module name of ``model`` (typos in ``--skip`` /
    ``modules_to_not_convert``)."""
    names = [name for name, _ in model.named_modules()]
    return [p for p in patterns if not any(matches_module(n, [p]) for n in names)]


def warn_unmatched(model: nn.Module, patterns: Sequence[str], what: str) -> list[str]:
    """Warn (once, naming them) about ``patterns`` that match no module of ``model``; return
    them. ``what`` names the option the patterns came from (``"modules_to_not_convert"``)."""
    missing = unmatched_patterns(model, patterns)
    if missing:
        warnings.warn(
            f"hf_fp8: {what} {missing} match(es) no module name of {type(model).__name__}, so "
            "it keeps nothing in high precision (a typo?)",
            UserWarning,
            stacklevel=3,
        )
    return missing


def unconverted_linears(model: nn.Module) -> list[str]:
    """Sorted names of the linear layers of ``model`` (``nn.Linear`` and subclasses, GPT-2
    ``Conv1D``) and of the MoE experts modules that are not FP8: what a saved config lists in
    ``modules_to_not_convert`` (so that a reload keeps them in high precision too)."""
    return sorted(
        name
        for name, module in model.named_modules()
        if (
            (isinstance(module, nn.Linear) or is_conv1d(module))
            and not isinstance(module, Fp8Linear)
        )
        or (is_experts_module(module) and not isinstance(module, Fp8Experts))
    )


# The words of high_precision_parts: what -> why (a why with {cls} names the module class).
HIGH_PRECISION_WHY = {
    "embeddings": "lookup tables, not matmuls (FP8 would save memory but no compute)",
    "biases": "added after the matmul in the compute dtype (1-D, tiny)",
    "norms and other 1-D tensors": "vectors, not matmul weights (tiny)",
    "MoE routers": (
        "kept in high precision on purpose: they pick the experts, and a flipped top-k "
        "choice costs more than the tiny matmul saves"
    ),
    "task heads": (
        "a task head (a linear outside the base model: score, classifier, qa_outputs ...) is "
        "kept by default: small, and trained with the task (peft's SEQ_CLS modules_to_save)"
    ),
    "convolutions": (
        "nn.Conv1d/2d/3d, not linears: hf_fp8 converts nn.Linear (and plain subclasses), "
        "GPT-2 Conv1D and MoE experts"
    ),
    "parameters used by their module's own code": (
        "{cls} uses these parameters itself in its forward (einsum, bmm or elementwise math "
        "on the tensor), not through an nn.Linear: converting them would need that forward "
        "rewritten, so they stay as they are"
    ),
}


def _what_and_why(
    module: nn.Module, name: str, pname: str, parent: nn.Module | None, skip: Sequence[str]
) -> tuple[str, str]:
    """(what, why) of one high-precision parameter ``pname`` of ``module`` (called ``name``)."""
    cls = type(module).__name__
    reason = keep_reason(module, name, parent=parent, skip=skip)
    if isinstance(module, nn.Embedding) or "embed" in pname:
        return "embeddings", HIGH_PRECISION_WHY["embeddings"]
    if pname.endswith("bias"):
        return "biases", HIGH_PRECISION_WHY["biases"]
    if reason is not None and reason.startswith("MoE experts:"):
        return "MoE experts not converted", reason.removeprefix("MoE experts: ")
    if _is_router_class(module) or (reason or "").startswith("MoE router"):
        return "MoE routers", HIGH_PRECISION_WHY["MoE routers"]
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return "linears kept in high precision", reason or (
            "left in high precision when the model was quantized (modules_to_not_convert / skip)"
        )
    if isinstance(module, nn.MultiheadAttention):
        return "linears kept in high precision", (
            "nn.MultiheadAttention passes in_proj_weight to F.multi_head_attention_forward "
            "itself (an FP8 weight there would be multiplied as raw codes)"
        )
    if isinstance(module, nn.modules.conv._ConvNd):
        return "convolutions", HIGH_PRECISION_WHY["convolutions"]
    if getattr(module, pname).dim() <= 1:
        return "norms and other 1-D tensors", HIGH_PRECISION_WHY["norms and other 1-D tensors"]
    what = "parameters used by their module's own code"
    return what, HIGH_PRECISION_WHY[what].format(cls=cls)


def high_precision_parts(
    model: nn.Module, *, skip: Sequence[str] = (), examples: int = 3
) -> list[dict[str, Any]]:
    """What stays in high precision in ``model`` and why, largest first:
    ``[{"what", "why", "parameters", "examples"}]`` (``parameters``: elements; ``examples``:
    up to ``examples`` parameter names). Works on a quantized model (what is not FP8; a
    linear the rules would convert was skipped then) and on a high-precision one, also on
    the meta device (what the swap would leave, with ``skip`` as ``modules_to_not_convert``). FP8 codes and their scales are not listed; a parameter
    shared by several modules counts once."""
    will_convert: set[int] = set()  # a quantized model is described as it is
    if not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules()):
        for _, module, _ in convertible_modules(model, skip=skip):
            will_convert.add(id(module.weight))
        experts = convertible_experts(model, skip=skip)
        experts += [e[:3] for e in convertible_outside_experts(model, skip=skip)]
        for _, module, _ in experts:
            for pname, p in module.named_parameters(recurse=False):
                if not pname.endswith("bias"):
                    will_convert.add(id(p))
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {id(model.get_submodule(name)) for name in task_heads(model)}
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    seen: set[int] = set()
    for name, module, parent, _ in _walk(model, "", None, False):
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or id(p) in will_convert or is_fp8(p.dtype):
                continue
            seen.add(id(p))
            if isinstance(module, (Fp8Linear, Fp8Experts)) and "scale" in pname:
                continue
            if module is output and pname == "weight":
                what, why = (
                    "output head",
                    (
                        "the output head (lm_head) is kept by default: the layer most sensitive "
                        "to FP8 rounding, and often tied to the input embeddings"
                    ),
                )
            elif id(module) in heads and pname == "weight":
                what, why = "task heads", HIGH_PRECISION_WHY["task heads"]
            else:
                what, why = _what_and_why(module, name, pname, parent, skip)
            group = groups.setdefault((what, why), {"what": what, "why": why, "parameters": 0})
            group["parameters"] += p.numel()
            shown = group.setdefault("examples", [])
            if len(shown) < examples:
                shown.append(f"{name}.{pname}" if name else pname)
    return sorted(groups.values(), key=lambda g: -g["parameters"])
