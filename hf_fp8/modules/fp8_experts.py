"""``Fp8Experts``: FP8 replacement for the fused experts module of a transformers MoE layer.

transformers 5.x declares the experts of ~65 MoE families as one module per layer with
fused 3-D parameters, through ``transformers.integrations.moe.use_experts_implementation``.
That decorator records the layout on every instance (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``, ``has_post_expert_norm``); :func:`experts_layout`
reads it, so no model name is listed here. :func:`unsupported_reason` says in words why a
module cannot convert (``None``: it can). ``Fp8Experts.from_experts`` quantizes one,
``dequantize`` gives the original class back.

Storage (one ``[out, in]`` weight per expert, as ``Fp8Linear`` stores one linear; the source
layout is transposed on the way in when ``is_transposed``)::

    {up}                 fp8   [E, N_up, H]   {up} = gate_up_proj (N_up = 2I, has_gate) | up_proj (N_up = I)
    down_proj            fp8   [E, H, I]
    {proj}_weight_scale  fp32  [E, 1] tensor | [E, N, 1] row | [E, ceil(N/bn), ceil(K/bk)] block
    {proj}_input_scale   fp32  [E]            static activations: one scale per expert
    {proj}_bias          compute dtype [E, N]  has_bias

Scale convention and recipe fields are ``Fp8Linear``'s (``high ≈ fp8.float() * scale``);
an interleaved ``gate_up`` (gpt-oss) keeps its row order, the class's own ``_apply_gate``
de-interleaves it. Forward: same call as the replaced module (``hidden_states``,
``top_k_index``, ``top_k_weights``; the router is untouched), computed only for the routed
pairs, grouped by expert (``hf_fp8.kernels.grouped``); the activation function,
``_apply_gate`` and ``post_expert_norm`` of the source class run unchanged, in high
precision. transformers' experts implementation choice (``eager``, ``grouped_mm``,
``batched_mm``: one math) all map onto that path; others (``deepgemm``, ``sonicmoe``, custom
registrations) cannot take these weights and raise.

Status (this file, ``hf_fp8/kernels/grouped.py``): all 68 experts classes of transformers
5.24 (discovered by ``tests/modules/moe_zoo.py``) convert and equal their own eager forward
on the dequantized weights; not decorated experts (``Llama4TextExperts``, ``DbrxExperts``,
``JetMoeParallelExperts``, ``Step3p7Experts``, ``LongcatFlashExperts``) and transformers' own
``FP8Experts`` are refused with a reason. CPU speed: see ``benchmarks/bench_moe_block.py``
(Qwen3-MoE-shaped block, 64 experts, top-8, H 2048, I 768, against bf16 ``grouped_mm`` in the
same run; results in ``benchmarks/results/moe_block.json``): one thread (its CPU clock), decode
about 0.4x and prefill (512 tokens) about 1.0x the bf16 time (targets 1.5x / 1.3x; before the
CPU grouped route of ``hf_fp8/kernels/grouped_cpu.py``: prefill 1.40x / 1.75x weight-only /
dynamic); 1.003 bytes per expert parameter with row scales.

Done since (H7): the quantizer swaps every experts module through the experts rule
(:func:`experts_keep_reason` / :func:`convertible_experts`, named in
``hf_fp8.modules.selection``; ``hf_fp8.quantizer.experts``), quantizes the merged bf16 tensors
on the fly, reloads its saves bit for bit (codes written per expert by transformers' reverse
mapping, scales under the merged names), validates and dequantizes; ``quantize_model`` converts
experts too; ``hf_fp8.serialization.experts`` imports ``fp8`` block checkpoints (one linear per
expert) and exports compressed-tensors / vllm-fp8 per expert; peft ``target_parameters`` on
these parameters is refused in ``forward`` with what to do; ``bench_moe_coverage``.

Still open:

* stock transformers 5.24 cannot load a compressed-tensors export with *block* expert scales
  (its ``CompressedTensorsDequantize`` multiplies codes by the ``[nb, kb]`` scale without
  expanding the blocks); row / tensor scales load and match hf_fp8 in fp32 (weight-only).
* FSDP2 sharding of the 3-D parameters (2 CPU ranks) is not tested.
* speed: prefill is at bf16 parity on one thread, not below it: the matmul is compute-bound
  (bf16 dot products either way) and the fp8 weights (302 MB for this block) still stream
  from memory once per call. The up projection quantizes each token once (per-token scales);
  experts small enough for the GEMV (decode, small batches) still quantize their own rows
  there (an ``fp8_linear`` taking a pre-quantized ``(a_fp8, a_scale)`` would remove that).
  ``route`` syncs the host once (``counts``) in eager mode; under ``torch.compile`` it returns
  a static routing and every expert runs on all rows (one graph, same numbers, ``E`` times the
  routed compute; ``E / top_k`` for the up projection): a grouped kernel taking device offsets
  (``torch._scaled_grouped_mm`` on GPU) would remove that cost.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_fp8.kernels.fp8_linear import fresh_output
from hf_fp8.kernels.grouped import combine, grouped_fp8_linear, route
from hf_fp8.modules.fp8_linear import input_scale_above_bound, refuse_fp8_compute_dtype
from hf_fp8.modules.frozen import check_frozen
from hf_fp8.modules.recipe_words import RecipeWords
from hf_fp8.numerics import dequantize, fp8_dtype, is_fp8, quantize_weight
from hf_fp8.numerics.checks import (
    check_fp8_tensor,
    check_scale_tensor,
    input_scale_problem,
    max_scale,
    min_input_scale,
)
from hf_fp8.numerics.quantize import block_scale_shape
from hf_fp8.recipe import Fp8Recipe

if TYPE_CHECKING:
    from hf_fp8.config import Fp8Config

# The layout flags that use_experts_implementation sets on every instance.
LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
# Experts implementations of transformers that compute the same math as Fp8Experts' path.
FP8_EXPERTS_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_HOOK_ATTRIBUTES = frozenset({"_hf_hook", "_old_forward"})


@dataclass(frozen=True)
class ExpertsLayout:
    """What transformers' experts decorator says about one experts module, plus its sizes."""

    source_class: type
    num_experts: int
    hidden_size: int
    intermediate_size: int
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    has_post_expert_norm: bool
    forward_args: tuple[str, ...]

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    @property
    def projections(self) -> tuple[str, str]:
        return (self.up_name, "down_proj")

    def shape(self, projection: str) -> tuple[int, int, int]:
        """``[E, out, in]`` of a projection as ``Fp8Experts`` stores it."""
        if projection == "down_proj":
            return (self.num_experts, self.hidden_size, self.intermediate_size)
        width = (2 if self.has_gate else 1) * self.intermediate_size
        return (self.num_experts, width, self.hidden_size)


def _source_forward(cls: type) -> Any:
    forward = cls.forward
    return getattr(forward, "__wrapped__", forward)


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of an experts module built on ``use_experts_implementation``; ``None`` when
    ``module`` carries no such metadata. Sizes are 0 when the weights do not tell them."""
    if isinstance(module, Fp8Experts):
        return module.layout
    if not all(isinstance(getattr(module, f, None), bool) for f in LAYOUT_FLAGS):
        return None
    if not callable(getattr(module, "_apply_gate", None)):
        return None
    flags = {f: getattr(module, f) for f in LAYOUT_FLAGS}
    up = getattr(module, "gate_up_proj" if flags["has_gate"] else "up_proj", None)
    down = getattr(module, "down_proj", None)
    num_experts = hidden = inter = 0
    if isinstance(down, torch.Tensor) and down.dim() == 3:
        num_experts, hidden, inter = down.shape  # [E, H, I]; transposed: [E, I, H]
        if flags["is_transposed"]:
            hidden, inter = inter, hidden
    elif isinstance(up, torch.Tensor) and up.dim() == 3:
        num_experts = up.shape[0]
    params = list(inspect.signature(_source_forward(type(module))).parameters)[1:]
    return ExpertsLayout(
        source_class=type(module),
        num_experts=int(num_experts),
        hidden_size=int(hidden),
        intermediate_size=int(inter),
        forward_args=tuple(params),
        **flags,
    )


def _expected_parameters(layout: ExpertsLayout) -> dict[str, tuple[int, ...]]:
    """Source-layout shapes of every weight and bias the experts module must hold."""
    out = {}
    for proj in layout.projections:
        e, n, k = layout.shape(proj)
        out[proj] = (e, k, n) if layout.is_transposed else (e, n, k)
        if layout.has_bias:
            out[f"{proj}_bias"] = (e, n)
    return out


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot become an ``Fp8Experts`` (``None``: it can)."""
    name = type(module).__name__
    if isinstance(module, Fp8Experts):
        return f"{name} is already FP8"
    layout = experts_layout(module)
    if layout is None:
        return (
            f"{name} is not built on transformers.integrations.moe.use_experts_implementation "
            f"(it lacks the layout flags {LAYOUT_FLAGS}); keep it in high precision"
        )
    if getattr(module, "_is_expert_parallel", False):
        return f"{name} is sharded for expert parallelism, which Fp8Experts does not support yet"
    if layout.num_experts == 0 or layout.hidden_size == 0 or layout.intermediate_size == 0:
        return f"{name} has no 3-D {layout.up_name} / down_proj weights to quantize"
    expected = _expected_parameters(layout)
    for pname, shape in expected.items():
        tensor = getattr(module, pname, None)
        if not isinstance(tensor, torch.Tensor):
            return f"{name} declares has_bias={layout.has_bias} but has no {pname} tensor"
        if tuple(tensor.shape) != shape:
            return f"{name}.{pname} has shape {tuple(tensor.shape)}, its layout implies {shape}"
        if is_fp8(tensor.dtype) or not tensor.is_floating_point():
            return (
                f"{name}.{pname} is {tensor.dtype}, not a high-precision float (already quantized?)"
            )
    allowed_children = {"act_fn"} | ({"post_expert_norm"} if layout.has_post_expert_norm else set())
    for pname, _ in module.named_parameters(recurse=False):
        if pname not in expected:
            return f"{name} holds a parameter {pname!r} that Fp8Experts does not know how to carry"
    for bname, _ in module.named_buffers(recurse=False):
        return f"{name} holds a buffer {bname!r} that Fp8Experts does not know how to carry"
    for child_name, child in module.named_children():
        if child_name not in allowed_children and any(True for _ in child.parameters()):
            return f"{name}.{child_name} has its own parameters; Fp8Experts would not run it"
    if layout.has_post_expert_norm and not isinstance(
        getattr(module, "post_expert_norm", None), nn.Module
    ):
        return f"{name} declares has_post_expert_norm but has no post_expert_norm module"
    if len(layout.forward_args) != 3:
        return (
            f"{name}.forward takes {layout.forward_args}, not (hidden_states, top_k_index, "
            "top_k_weights)"
        )
    if "__class__" in getattr(layout.source_class._apply_gate, "__code__", object).co_freevars:
        return f"{name}._apply_gate calls super(), which cannot run on Fp8Experts"
    return None


def is_experts_module(module: nn.Module) -> bool:
    """An MoE experts module with fused 3-D weights: built on transformers' experts
    decorator, or a class named ``*Experts`` holding a 3-D parameter of its own."""
    if isinstance(module, Fp8Experts) or experts_layout(module) is not None:
        return True
    return type(module).__name__.endswith("Experts") and any(
        p.dim() == 3 for _, p in module.named_parameters(recurse=False)
    )


def experts_keep_reason(
    module: nn.Module,
    name: str,
    *,
    skip: Sequence[str] = (),
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> str | None:
    """The *experts* rule of ``hf_fp8.modules.selection``: why the experts module ``module``
    (called ``name``) stays as it is, or ``None`` when it becomes an ``Fp8Experts``. Not an
    experts module: ``"not an experts module"``; one that cannot convert: its
    :func:`unsupported_reason` (kept in high precision, named on the card)."""
    from hf_fp8.modules.selection import matches_module

    if not is_experts_module(module):
        return "not an experts module"
    reason = unsupported_reason(module)
    if reason is not None:
        return reason
    if matches_module(name, skip):
        return "named in modules_to_not_convert / skip"
    if module_filter_fn is not None and not module_filter_fn(module, name):
        return "module_filter_fn returned False"
    return None


def convertible_experts(
    model: nn.Module,
    *,
    skip: Sequence[str] = (),
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, module, parent)`` of every experts module of ``model`` that converts to
    ``Fp8Experts`` (once per parent when shared), in module order."""
    found = []

    def walk(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if is_experts_module(child):
                if (
                    experts_keep_reason(child, name, skip=skip, module_filter_fn=module_filter_fn)
                    is None
                ):
                    found.append((name, child, module))
                continue
            walk(child, name)

    walk(model, "")
    return found


def unconverted_experts(model: nn.Module) -> dict[str, str]:
    """Experts modules of ``model`` that are not FP8, with the reason (for cards / inspect)."""
    return {
        name: unsupported_reason(m) or "kept in high precision (modules_to_not_convert)"
        for name, m in model.named_modules()
        if is_experts_module(m) and not isinstance(m, Fp8Experts)
    }


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    """The instance attributes that are not nn.Module bookkeeping, tensors or hooks."""
    out = {}
    for key, value in vars(module).items():
        if key in _MODULE_INTERNALS or key in _HOOK_ATTRIBUTES:
            continue
        if isinstance(value, torch.Tensor) or getattr(value, "__self__", None) is module:
            continue
        out[key] = value
    return out


def config_recipe(config: Fp8Config | None) -> Fp8Recipe:
    """``config.recipe``, or the default recipe without a config."""
    return Fp8Recipe.resolve() if config is None else config.recipe


def quantize_projection(
    weight_hp: torch.Tensor, layout: ExpertsLayout, recipe: Fp8Recipe, *, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes ``[E, out, in]`` and per-expert scales of one projection given in the
    *source* layout (``[E, in, out]`` when ``layout.is_transposed``), e.g. a merged
    checkpoint tensor. Each expert is quantized alone (``quantize_weight``: finite check
    naming ``name[expert e]``, absmax or MSE scales)."""
    if weight_hp.dim() != 3 or weight_hp.shape[0] != layout.num_experts:
        raise ValueError(
            f"{name} must be [{layout.num_experts}, ...] (one matrix per expert), got "
            f"{tuple(weight_hp.shape)}"
        )
    if layout.is_transposed:
        weight_hp = weight_hp.transpose(-2, -1)
    dtype = fp8_dtype(recipe.fp8_format)
    pairs = [
        quantize_weight(
            weight_hp[e],
            dtype,
            recipe.weight_granularity.value,
            recipe.block_size,
            name=f"{name}[expert {e}]",
            scale_method=recipe.weight_scale_method.value,
        )
        for e in range(weight_hp.shape[0])
    ]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _scale_shape(granularity: str, n: int, k: int, block_size: tuple[int, int]) -> tuple:
    if granularity == "tensor":
        return (1,)
    if granularity == "row":
        return (n, 1)
    return block_scale_shape((n, k), block_size)


def checked_source_layout(
    module: nn.Module, module_name: str, layout: ExpertsLayout | None, kind: str
) -> ExpertsLayout:
    """``layout`` of a high-precision ``module`` of another experts ``kind`` (bmm, parallel),
    or ``ValueError`` naming why it cannot convert."""
    name = module_name or type(module).__name__
    if layout is None:
        raise ValueError(f"cannot convert {name}: it is not {kind}")
    for proj in layout.projections:
        tensor = getattr(module, proj)
        if is_fp8(tensor.dtype) or not tensor.is_floating_point():
            raise ValueError(f"cannot convert {name}: {proj} is {tensor.dtype}, not high precision")
    return layout


class Fp8Experts(RecipeWords, nn.Module):
    """Experts with FP8 weights and per-expert fp32 scales (see the module docstring).

    Build with :meth:`from_experts`; the constructor makes empty storage for a ``layout``
    (on meta when the quantizer swaps modules before loading). Non-weight parts of the
    source (``act_fn``, ``post_expert_norm``, plain attributes such as ``limit``) are
    carried over by ``from_experts`` so the source class's ``_apply_gate`` runs on this module.
    """

    def __init__(
        self,
        layout: ExpertsLayout,
        recipe: Fp8Recipe | None = None,
        *,
        input_scale: float | torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Empty storage for ``layout`` with ``recipe`` (default: ``Fp8Recipe.resolve()``,
        dynamic per-token activations, row weight scales, e4m3)."""
        super().__init__()
        recipe = recipe if recipe is not None else Fp8Recipe.resolve()
        if not isinstance(recipe, Fp8Recipe):
            raise TypeError(f"recipe must be an hf_fp8.recipe.Fp8Recipe, got {type(recipe)}")
        self.layout = layout
        self.recipe = recipe
        self.compute_dtype = dtype or torch.get_default_dtype()
        self._source_attributes: dict[str, Any] = {}
        w_dtype = fp8_dtype(recipe.fp8_format)
        for proj in layout.projections:
            e, n, k = layout.shape(proj)
            weight = torch.empty(e, n, k, dtype=w_dtype, device=device)
            scale = torch.empty(
                e, *_scale_shape(recipe.weight_granularity, n, k, recipe.block_size), device=device
            )
            bias = (
                torch.empty(e, n, dtype=self.compute_dtype, device=device)
                if layout.has_bias
                else None
            )
            if not weight.is_meta:
                weight.zero_()
                scale.fill_(1.0)
                if bias is not None:
                    bias.zero_()
            self.register_parameter(proj, nn.Parameter(weight, requires_grad=False))
            self.register_parameter(
                f"{proj}_weight_scale", nn.Parameter(scale, requires_grad=False)
            )
            self.register_parameter(f"{proj}_bias", None if bias is None else nn.Parameter(bias))
            self.register_parameter(f"{proj}_input_scale", None)
            if input_scale is not None:
                self.set_input_scale(proj, _placeholder(input_scale, weight))

    # -- recipe -------------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def activation_scheme(self) -> str:
        return self.recipe.activation_scheme.value

    @property
    def kernel(self) -> str:
        return self.recipe.kernel.value

    def set_input_scale(self, projection: str, scale: float | torch.Tensor) -> None:
        """Static activation scale of ``projection``: one number for every expert or ``[E]``."""
        if not self.recipe.is_static:
            raise ValueError(
                f"input scales are only used by activation_scheme='static', these experts are "
                f"{self.activation_scheme!r}"
            )
        if projection not in self.layout.projections:
            raise ValueError(f"projection must be one of {self.layout.projections}")
        scale = torch.as_tensor(scale, dtype=torch.float32).detach()
        scale = scale.reshape(-1).expand(self.num_experts).clone()
        name = self.__dict__.get("fp8_name")
        shown = f"{name}.{projection} input scales" if name else f"{projection} input scales"
        dtype = fp8_dtype(self.fp8_format)
        problem = input_scale_problem(shown, scale, dtype) or input_scale_above_bound(
            shown, scale, dtype, self.compute_dtype
        )
        if problem is not None:
            raise ValueError(problem)
        device = getattr(self, projection).device
        if device.type == "meta" and not scale.is_meta:
            raise ValueError(
                f"{self.__dict__.get('fp8_name') or 'these experts'}: {projection} is on the "
                "meta device (offloaded by accelerate's device_map to disk or CPU, or not "
                "loaded yet), so input scales set here would be dropped, not used nor saved. "
                "Set them on the model loaded without offloading, save_pretrained it, and "
                "reload the saved folder with the device_map"
            )
        with torch.inference_mode(False):  # a normal tensor, as Fp8Linear.set_input_scale
            setattr(
                self,
                f"{projection}_input_scale",
                nn.Parameter(scale.to(device).clone(), requires_grad=False),
            )

    @classmethod
    def _source_layout(cls, module: nn.Module, module_name: str) -> ExpertsLayout:
        """The layout of the high-precision ``module`` this class converts, or
        ``ValueError`` naming why it cannot (subclasses: other kinds of experts)."""
        reason = unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"cannot convert {module_name or type(module).__name__}: {reason}")
        return experts_layout(module)

    @classmethod
    def from_experts(
        cls, module: nn.Module, config: Fp8Config | None = None, *, module_name: str = ""
    ) -> Fp8Experts:
        """Quantize an experts module (finite weights) with ``config``'s recipe; each expert
        gets its own scales. Raises ``ValueError`` with :func:`unsupported_reason`."""
        layout = cls._source_layout(module, module_name)
        recipe = config_recipe(config)
        source_dtype = getattr(module, layout.projections[0]).dtype
        with torch.device("meta"):
            new = cls(layout, recipe, dtype=source_dtype)
        prefix = f"{module_name}." if module_name else ""
        for proj in layout.projections:
            codes, scales = quantize_projection(
                getattr(module, proj).detach(), layout, recipe, name=f"{prefix}{proj}"
            )
            setattr(new, proj, nn.Parameter(codes, requires_grad=False))
            setattr(new, f"{proj}_weight_scale", nn.Parameter(scales, requires_grad=False))
            if layout.has_bias:
                bias = getattr(module, f"{proj}_bias")
                setattr(
                    new,
                    f"{proj}_bias",
                    nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad),
                )
        new._set_config_input_scales(config, prefix)
        new._carry_over(module)
        if module_name:
            new.__dict__["fp8_name"] = module_name  # named in errors, as Fp8Linear.from_linear
        return new

    @classmethod
    def empty_like(
        cls,
        module: nn.Module,
        config: Fp8Config | None = None,
        *,
        module_name: str = "",
        device: torch.device | str | None = None,
    ) -> Fp8Experts:
        """Storage for ``module``'s layout and ``config``'s recipe, to be filled by a
        checkpoint (the quantizer's swap before loading), on ``module``'s device unless
        ``device`` is given (meta stays meta). Carries the non-weight parts over as
        ``from_experts`` does; static input scales from the config are set, others come
        from the checkpoint."""
        layout = cls._source_layout(module, module_name)
        source_weight = getattr(module, layout.projections[0])
        device = device if device is not None else source_weight.device
        new = cls(layout, config_recipe(config), dtype=source_weight.dtype, device=device)
        new._set_config_input_scales(config, f"{module_name}." if module_name else "")
        new._carry_over(module)
        return new

    def _set_config_input_scales(self, config: Fp8Config | None, prefix: str) -> None:
        """Static input scales that ``config`` gives for this module's projections."""
        if config is None or not self.recipe.is_static:
            return
        for proj in self.layout.projections:
            scale = config.activation_scale_for(f"{prefix}{proj}")
            if scale is not None:
                self.set_input_scale(proj, _placeholder(scale, getattr(self, proj)))

    def _carry_over(self, module: nn.Module) -> None:
        """Take the source's plain attributes and parameter-free (or norm) children."""
        attributes = _plain_attributes(module)
        for key, value in attributes.items():
            # never shadow this module's own recipe attributes, properties or parameters
            if key in self.__dict__ or hasattr(type(self), key) or key in self._parameters:
                continue
            self.__dict__[key] = value
        self._source_attributes = attributes
        for child_name, child in module.named_children():
            self.add_module(child_name, child)
        self.__dict__["is_transposed"] = False  # stored [E, out, in] whatever the source

    # -- forward -----------------------------------------------------------------------

    def _check_implementation(self) -> None:
        config = getattr(self, "config", None)
        impl = getattr(config, "_experts_implementation", None)
        if impl not in FP8_EXPERTS_IMPLEMENTATIONS:
            raise NotImplementedError(
                f"experts_implementation={impl!r} cannot run FP8 experts; hf_fp8 runs them with "
                f"its own grouped kernel under any of {FP8_EXPERTS_IMPLEMENTATIONS[1:]}: call "
                "model.set_experts_implementation('grouped_mm')"
            )

    def _check_frozen(self) -> None:
        """In grad mode: the fp8 codes and scales must not ask for a gradient (none reaches
        them; see ``hf_fp8.modules.frozen``)."""
        if torch.is_grad_enabled():
            names = self.layout.projections
            check_frozen(
                self,
                (
                    *names,
                    *(f"{p}_weight_scale" for p in names),
                    *(f"{p}_input_scale" for p in names),
                ),
            )

    def _check_call(self) -> None:
        """Refuse what the grouped kernels cannot run, naming the fix: ``torch.func.vmap``
        (R31 F7: the routing groups tokens by expert with host-side counts; ``grad`` /
        ``jacrev`` run), and a static recipe without input scales (R31 F5)."""
        from hf_fp8.kernels.cpu_linear import functorch_active

        name = self.__dict__.get("fp8_name")
        if functorch_active():
            from torch._C._functorch import TransformType
            from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

            if any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters()):
                raise NotImplementedError(
                    f"FP8 experts {name or self.layout.source_class.__name__}: torch.func.vmap "
                    "cannot run them (tokens are grouped by expert with host-side counts). Pass "
                    "the samples as one batch of tokens (the experts take any number), or loop "
                    "over them; torch.func.grad / jacrev / vjp work without vmap"
                )
        if self.recipe.is_static:
            missing = [
                p for p in self.layout.projections if getattr(self, f"{p}_input_scale") is None
            ]
            if missing:
                keys = ", ".join(f"'{name or '<experts>'}.{p}': ..." for p in missing)
                raise RuntimeError(
                    f"static FP8 experts {name or '(unnamed)'} have no input scales for "
                    f"{missing}: calibrate them with hf_fp8.calibrate(model, batches), or give "
                    f"Fp8Config('static', activation_scale=...) (every layer) or "
                    f"activation_scales={{{keys}}} (one scale for all experts of a projection)"
                )

    def _check_not_parametrized(self) -> None:
        """peft's ``target_parameters`` (LoRA on a parameter) registers a parametrization
        that adds a high-precision delta to the stored tensor: here fp8 codes without their
        per-expert scales. Refused with what to do instead."""
        from torch.nn.utils import parametrize

        from hf_fp8.modules.origin import how_to_keep

        if parametrize.is_parametrized(self):
            names = sorted(getattr(self, "parametrizations", {}).keys())
            raise NotImplementedError(
                f"LoRA on the FP8 expert parameters {names} of {self.layout.source_class.__name__} "
                "(peft target_parameters) is not supported: the adapter delta would be added to "
                "fp8 codes without their per-expert scales. Put LoRA on the attention and dense "
                "layers instead (LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', "
                "'o_proj'])); or, to train them, keep these experts in high precision: "
                f"{how_to_keep(self, ['experts'])}"
            )

    def _project(
        self, proj: str, x: torch.Tensor, routing, *, from_tokens: bool = False
    ) -> torch.Tensor:
        """``proj`` of the routed rows ``x`` (sorted by expert), or, ``from_tokens``, of the
        token rows each pair reads (each token quantized once, not once per expert it
        reaches). Calibration wraps this method on the instance."""
        return grouped_fp8_linear(
            x,
            routing,
            getattr(self, proj),
            getattr(self, f"{proj}_weight_scale"),
            getattr(self, f"{proj}_bias"),
            recipe=self.recipe,
            input_scale=getattr(self, f"{proj}_input_scale"),
            from_tokens=from_tokens,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        **kwargs: torch.Tensor,
    ) -> torch.Tensor:
        """Same call as the replaced experts module: ``(hidden_states [T, H], top_k_index
        [T, k], top_k_weights [T, k])`` (its own keyword names are accepted too)."""
        names = self.layout.forward_args[1:]
        if top_k_index is None and len(names) == 2:
            top_k_index = kwargs.pop(names[0], None)
        if top_k_weights is None and len(names) == 2:
            top_k_weights = kwargs.pop(names[1], None)
        if top_k_index is None or top_k_weights is None or kwargs:
            raise TypeError(
                f"{type(self).__name__}.forward takes (hidden_states, {', '.join(names)}); got "
                f"extra or missing arguments {sorted(kwargs) or ''}"
            )
        self._check_implementation()
        self._check_not_parametrized()
        self._check_call()
        self._check_frozen()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if x.shape[0] == 0:
            # an empty batch routes nothing (and reshape(0, -1) cannot infer top_k): an empty
            # output of the input's shape, on the inputs' autograd graph as the high-precision
            # grouped_mm / batched_mm experts' output is
            return hidden_states * top_k_weights.sum().to(hidden_states.dtype)
        index = top_k_index.reshape(x.shape[0], -1)
        routing = route(index, self.num_experts)
        h = self._project(self.layout.up_name, x, routing, from_tokens=True)
        if self.layout.has_gate:
            h = self.layout.source_class._apply_gate(self, h)
        else:
            h = self.act_fn(h)
        h = self._project("down_proj", h, routing)
        if self.layout.has_post_expert_norm:
            h = self.post_expert_norm(h)
        weights = top_k_weights.reshape(x.shape[0], -1)
        # not a view (R25 F7): FSDP2 (fully_shard_fp8) warns that out += ... on a view
        # output drops the pre-backward hook (backward then reads the freed fp8 weights)
        return fresh_output(combine(h, routing, weights, hidden_states.dtype), tuple(shape))

    # -- back to high precision ----------------------------------------------------------

    def dequantize_weight(self, projection: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[E, out, in]`` high-precision weight of ``projection``."""
        weight = getattr(self, projection)
        scale = getattr(self, f"{projection}_weight_scale")
        dtype = dtype or self.compute_dtype
        return torch.stack(
            [
                dequantize(weight[e], scale[e], dtype, self.weight_granularity, self.block_size)
                for e in range(weight.shape[0])
            ]
        )

    def dequantize(self) -> nn.Module:
        """An instance of the source class in ``compute_dtype`` with the dequantized weights."""
        cls = self.layout.source_class
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.__dict__.update(self._source_attributes)
        for child_name, child in self.named_children():
            module.add_module(child_name, child)
        for proj in self.layout.projections:
            weight = self.dequantize_weight(proj)
            if self.layout.is_transposed:
                weight = weight.transpose(-2, -1).contiguous()
            module.register_parameter(proj, nn.Parameter(weight))
            bias = getattr(self, f"{proj}_bias")
            if self.layout.has_bias:
                module.register_parameter(
                    f"{proj}_bias", nn.Parameter(bias.detach().to(self.compute_dtype).clone())
                )
        return module

    # -- nn.Module plumbing --------------------------------------------------------------

    def _frozen(self) -> list[torch.Tensor]:
        out = []
        for proj in self.layout.projections:
            for name in (proj, f"{proj}_weight_scale", f"{proj}_input_scale"):
                tensor = getattr(self, name)
                if tensor is not None:
                    out.append(tensor)
        return out

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` changes the compute dtype and biases, never fp8 codes or scales."""
        frozen = self._frozen()

        def keep_storage_dtype(t: torch.Tensor) -> torch.Tensor:
            if any(t is p for p in frozen):
                probe = fn(t.detach()[:0])
                if probe.dtype != t.dtype:
                    return t.to(device=probe.device)
            return fn(t)

        compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        refuse_fp8_compute_dtype(self, compute_dtype)
        self.compute_dtype = compute_dtype
        return super()._apply(keep_storage_dtype, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Refuse high-precision expert weights (quantize them with ``from_experts``), fp8
        codes of the other format or another shape, weight scales that are not finite, > 0 and bounded in the module's shape, and
        input scales that are not ``[E]`` finite values in ``[min_input_scale, max_scale]``
        (``CheckpointTensorError`` naming the key, as ``Fp8Linear``), and make room for
        static input scales when a module built without them loads some."""
        dtype = fp8_dtype(self.fp8_format)
        for proj in self.layout.projections:
            weight = state_dict.get(prefix + proj)
            if weight is not None and not is_fp8(weight.dtype):
                raise ValueError(
                    f"{prefix}{proj} is {weight.dtype}, not fp8: this is a high-precision state "
                    "dict; quantize the experts with Fp8Experts.from_experts instead"
                )
            if weight is not None:  # the config's fp8 format and the module's shape (R31 F2:
                # copy_ would convert e5m2 codes into e4m3 ones, saturating at 448)
                check_fp8_tensor(
                    prefix + proj,
                    weight,
                    dtype=dtype,
                    shape=tuple(getattr(self, proj).shape),
                    check_values=False,
                )
            key = f"{proj}_weight_scale"
            scale = state_dict.get(prefix + key)
            if scale is not None:  # finite, > 0, bounded, the module's own shape
                check_scale_tensor(
                    prefix + key,
                    scale,
                    shape=tuple(getattr(self, key).shape),
                    max_value=max_scale(dtype, self.compute_dtype),
                )
            key = f"{proj}_input_scale"
            scale = state_dict.get(prefix + key)
            if scale is not None:
                check_scale_tensor(
                    prefix + key,
                    scale,
                    shape=(self.num_experts,),
                    max_value=max_scale(dtype, self.compute_dtype),
                    min_value=min_input_scale(dtype),
                )
        for proj in self.layout.projections:  # all checked first: nothing half-changed
            key = f"{proj}_input_scale"
            if (
                state_dict.get(prefix + key) is not None
                and getattr(self, key) is None
                and self.recipe.is_static
            ):
                device = getattr(self, proj).device
                empty = torch.empty(self.num_experts, dtype=torch.float32, device=device)
                setattr(self, key, nn.Parameter(empty, requires_grad=False))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        layout = self.layout
        act = (
            "high precision (weight-only)"
            if not self.recipe.quantizes_activations
            else f"{self.fp8_format}/{self.activation_granularity}"
        )
        return (
            f"source={layout.source_class.__name__}, num_experts={layout.num_experts}, "
            f"hidden={layout.hidden_size}, intermediate={layout.intermediate_size}, "
            f"gate={layout.has_gate}, bias={layout.has_bias}, scheme={self.activation_scheme}, "
            f"weight={self.fp8_format}/{self.weight_granularity}, activation={act}, "
            f"compute_dtype={self.compute_dtype}, kernel={self.kernel}"
        )


def bytes_per_parameter(module: Fp8Experts) -> float:
    """Bytes stored per expert weight element (fp8 codes + scales + input scales)."""
    elements = sum(math.prod(getattr(module, p).shape) for p in module.layout.projections)
    stored = sum(t.numel() * t.element_size() for t in module._frozen())
    return stored / elements


def _placeholder(scale: float | torch.Tensor, weight: torch.Tensor) -> float | torch.Tensor:
    """A meta stand-in for ``scale`` when ``weight`` is on meta (built before loading, e.g.
    the quantizer's swap or ``init_empty_weights``): the load fills it."""
    if not weight.is_meta:
        return scale
    return torch.as_tensor(scale, dtype=torch.float32, device="meta")
