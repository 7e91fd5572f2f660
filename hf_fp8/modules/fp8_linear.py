"""``Fp8Linear``: an ``nn.Linear`` whose weight is stored in FP8 with fp32 scales."""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_fp8.kernels import LinearPlan, fp8_linear
from hf_fp8.kernels.fp8_linear import autocast_dtype
from hf_fp8.modules.frozen import check_frozen
from hf_fp8.modules.recipe_words import RecipeWords
from hf_fp8.modules.saturation import SaturationCounter
from hf_fp8.numerics import dequantize, fp8_dtype, fp8_max, is_fp8, quantize_weight
from hf_fp8.numerics.checks import (
    check_fp8_tensor,
    check_scale_tensor,
    input_scale_problem,
    max_scale,
    min_input_scale,
)
from hf_fp8.recipe import Fp8Recipe, Granularity

if TYPE_CHECKING:
    from hf_fp8.config import Fp8Config

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_float32(value: float) -> float:
    """``value`` rounded to float32 as it is stored (inf past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def input_scale_above_bound(
    name: str, scale: float | torch.Tensor, fp8: torch.dtype, compute_dtype: torch.dtype
) -> str | None:
    """Why ``scale`` (a number or tensor of static input scales, already positive and finite)
    exceeds ``max_scale(fp8, compute_dtype)``, the bound a checkpoint load refuses past, or
    ``None``. Judged on the float32 value stored, as the loader judges it (reviewer R27 F9: a
    scale set past it saved fine and could not be reloaded). Meta tensors are not read."""
    bound = max_scale(fp8, compute_dtype)
    if isinstance(scale, torch.Tensor):
        t = scale.detach()
        if t.is_meta or not t.numel():
            return None
        high = float(t.float().max())
    else:  # no torch op: this runs under `with torch.device("meta")` too
        high = _as_float32(float(scale))
    if high <= bound:
        return None
    return (
        f"{name}: {high:g} exceeds the largest input scale {bound:.6g} (min(the {compute_dtype} "
        f"compute dtype's max, 2**64) / fp8_max, the bound a checkpoint load accepts): an "
        f"activation amax of {high * fp8_max(fp8):.3g} is beyond FP8's reach at any scale a "
        "saved model may hold, so this model could not be reloaded. Find why the activations "
        "are this large (a diverged or corrupted layer before it, e.g. a norm weight), or keep "
        "this layer in high precision (Fp8Config(modules_to_not_convert=[...]), or "
        "quantize_model(skip=[...]))"
    )


def refuse_fp8_compute_dtype(
    module: nn.Module, dtype: torch.dtype, *, whole_model: bool = False
) -> None:
    """``model.to(torch.float8_e4m3fn)`` (or ``.type(...)``) would make an FP8 dtype the
    compute dtype of ``module`` (R31 P21: its forward then failed with a confusing input
    dtype error). Refused before ``module`` changes; what torch cast before reaching it (as
    it casts a float model) stays cast. ``whole_model``: called before any module changed
    (a check on the model's own ``.to``)."""
    if not is_fp8(dtype):
        return
    name = module.__dict__.get("fp8_name") or type(module).__name__
    if whole_model:
        changed = "Nothing was changed."
    else:
        changed = (
            "This layer is unchanged; modules torch cast before reaching it (e.g. the "
            "embeddings) are now FP8 as in a float model cast this way: reload the model "
            "before using it."
        )
    wanted = str(dtype).removeprefix("torch.")
    raise TypeError(
        f"{name}: casting the model to {wanted} is not supported: FP8 layers already store "
        f"their weights in FP8 and compute in a high-precision dtype (bfloat16, float16 or "
        f"float32), which .to({wanted}) would replace. Keep a high-precision dtype, e.g. "
        "model.to(torch.bfloat16); to store more layers in FP8 use Fp8Config or "
        f"hf_fp8.quantize_model. {changed}"
    )


def weight_scale_shape(
    out_features: int, in_features: int, granularity: str, block_size: tuple[int, int]
) -> tuple[int, ...]:
    """Shape of the fp32 weight scale of an ``[out, in]`` weight."""
    if granularity == Granularity.TENSOR:
        return (1,)
    if granularity == Granularity.ROW:
        return (out_features, 1)
    return (math.ceil(out_features / block_size[0]), math.ceil(in_features / block_size[1]))


class Fp8Linear(RecipeWords, nn.Linear):
    """Linear layer with an FP8 weight: ``y = x @ (weight.float() * weight_scale).T + bias``.

    Parameters: ``weight`` (fp8, ``[out, in]``), ``weight_scale`` (fp32, ``[1]``,
    ``[out, 1]`` or per 128×128 block), ``input_scale`` (fp32 ``[1]``, static only) and
    ``bias`` in ``compute_dtype``. The FP8 weight and the scales never require grad (the
    bias keeps its source layer's flag); gradients flow to the input.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        activation_scheme: str = "dynamic",
        weight_granularity: str = "row",
        activation_granularity: str | None = "auto",
        fp8_format: str = "e4m3",
        block_size: tuple[int, int] = (128, 128),
        kernel: str = "auto",
        input_scale: float | torch.Tensor | None = None,
        recipe: Fp8Recipe | None = None,
    ) -> None:
        """The scheme words are resolved once into ``self.recipe`` (an ``Fp8Recipe``);
        ``recipe=`` gives a resolved one directly (it then wins over the words).
        ``activation_granularity="auto"`` (or ``None``) takes the recipe's default."""
        nn.Module.__init__(self)
        if recipe is None:
            recipe = Fp8Recipe.resolve(
                activation_scheme,
                weight_granularity=weight_granularity,
                activation_granularity=(
                    None if activation_granularity == "auto" else activation_granularity
                ),
                fp8_format=fp8_format,
                block_size=block_size,
                kernel=kernel,
            )
        compute_dtype = dtype or torch.get_default_dtype()
        # Plain attributes go straight into __dict__, as nn.Module.__init__ does its own:
        # Module.__setattr__ costs microseconds each, and a model load builds one module per
        # linear layer.
        self.__dict__.update(
            in_features=in_features,
            out_features=out_features,
            recipe=recipe,
            _plan=LinearPlan.from_recipe(recipe),
            compute_dtype=compute_dtype,
        )
        scale_shape = weight_scale_shape(
            out_features, in_features, recipe.weight_granularity, recipe.block_size
        )
        # Fill only real storage: the quantizer and ``from_linear`` build on meta, where a fill
        # is a needless op (and, per module, a costly one).
        weight = torch.empty(
            out_features, in_features, device=device, dtype=fp8_dtype(recipe.fp8_format)
        )
        weight_scale = torch.empty(scale_shape, device=device, dtype=torch.float32)
        bias_hp = torch.empty(out_features, device=device, dtype=compute_dtype) if bias else None
        if not weight.is_meta:
            weight.zero_()
            weight_scale.fill_(1.0)
            if bias_hp is not None:
                bias_hp.zero_()
        self.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        self.register_parameter("weight_scale", nn.Parameter(weight_scale, requires_grad=False))
        self.register_parameter("bias", None if bias_hp is None else nn.Parameter(bias_hp))
        self.register_parameter("input_scale", None)
        if input_scale is not None:
            if weight.is_meta:  # deferred init (init_empty_weights, FSDP2): the load fills it
                input_scale = self._checked_scale(input_scale).to("meta")
            self.set_input_scale(input_scale)

    # -- the recipe: resolved once, read through these properties --------------------------------
    def set_recipe(self, recipe: Fp8Recipe) -> None:
        """Switch to another recipe with the same storage (format, weight granularity, block
        size); e.g. calibration runs a static layer as weight-only while it observes."""
        old = self.recipe
        if (recipe.fp8_format, recipe.weight_granularity, recipe.block_size) != (
            old.fp8_format,
            old.weight_granularity,
            old.block_size,
        ):
            raise ValueError(
                "set_recipe cannot change the stored format, weight granularity or block size "
                f"({old.fp8_format}/{old.weight_granularity}/{old.block_size}); re-quantize "
                "from the high-precision layer instead"
            )
        self.__dict__.update(recipe=recipe, _plan=LinearPlan.from_recipe(recipe))

    @property
    def activation_scheme(self) -> str:
        """The recipe's words as plain strings (the recipe itself holds the enums)."""
        return self.recipe.activation_scheme.value

    @activation_scheme.setter
    def activation_scheme(self, scheme: str) -> None:
        """Re-resolves the recipe (the activation granularity takes the new scheme's default
        unless it stays valid)."""
        recipe = self.recipe
        try:
            new = dataclasses.replace(recipe, activation_scheme=scheme)
        except ValueError:
            new = dataclasses.replace(
                recipe,
                activation_scheme=scheme,
                activation_granularity=Fp8Recipe.resolve(
                    scheme, weight_granularity=recipe.weight_granularity
                ).activation_granularity,
            )
        self.set_recipe(new)

    @property
    def kernel(self) -> str:
        return self.recipe.kernel.value

    @kernel.setter
    def kernel(self, kernel: str) -> None:
        self.set_recipe(dataclasses.replace(self.recipe, kernel=kernel))

    def reset_parameters(self) -> None:
        """No-op: FP8 weights come from ``from_linear`` or a checkpoint, never random init."""

    def _checked_scale(self, scale: float | torch.Tensor) -> torch.Tensor:
        """``scale`` as fp32 ``[1]``: a static layer only, positive, finite, at least
        ``min_input_scale`` of the fp8 format and at most ``max_scale`` of the format and
        compute dtype (what a checkpoint load accepts; a meta value cannot be checked)."""
        if not self.recipe.is_static:
            raise ValueError(
                f"input_scale is only used by activation_scheme='static', this layer is "
                f"{self.activation_scheme!r}"
            )
        name = self.__dict__.get("fp8_name")
        problem = input_scale_problem(
            f"{name}.input_scale" if name else "input_scale",
            scale if isinstance(scale, torch.Tensor) else float(scale),
            fp8_dtype(self.fp8_format),
        )
        problem = problem or input_scale_above_bound(
            f"{name}.input_scale" if name else "input_scale",
            scale if isinstance(scale, torch.Tensor) else float(scale),
            fp8_dtype(self.fp8_format),
            self.compute_dtype,
        )
        if problem is not None:
            raise ValueError(problem)
        return torch.as_tensor(scale, dtype=torch.float32).reshape(1)

    def set_input_scale(self, scale: float | torch.Tensor) -> None:
        """Set the static activation scale (``x ≈ x_fp8 * scale``). A value is refused on
        a layer whose weight is on the meta device (offloaded): it could not be kept there;
        a meta layer takes a meta scale (built before loading)."""
        scale = self._checked_scale(scale)
        if not scale.is_meta and self.weight.is_meta:
            raise ValueError(
                f"{self.__dict__.get('fp8_name') or 'this layer'}: the weight is on the meta "
                "device (offloaded by accelerate's device_map to disk or CPU, or not loaded "
                "yet), so an input_scale set here would be dropped, not used nor saved. Set "
                "it on the model loaded without offloading, save_pretrained it, and reload the "
                "saved folder with the device_map"
            )
        # a normal tensor even under torch.inference_mode() (R31 F10): an inference tensor
        # has no version counter and cannot be updated outside inference mode (a later
        # load_state_dict or calibrate), where the float model has no such limit
        with torch.inference_mode(False):
            scale = scale.detach().to(self.weight.device, copy=True)
            self.input_scale = nn.Parameter(scale, requires_grad=False)
        # the clipping counts were taken under the old scale (R27 F5): saturation_fraction()
        # must not report them before the next forward (the counter itself restarts there)
        self.__dict__.pop("_saturation", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: Fp8Config | None = None, *, module_name: str = ""
    ) -> Fp8Linear:
        """Quantize an ``nn.Linear`` (its weight must be finite) with ``config``'s recipe."""
        recipe = config.recipe if config is not None else Fp8Recipe.resolve()
        input_scale = config.activation_scale_for(module_name) if config is not None else None
        weight_hp = linear.weight.detach()
        compute_dtype = weight_hp.dtype if not is_fp8(weight_hp.dtype) else torch.bfloat16
        with torch.device("meta"):
            new = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                dtype=compute_dtype,
                recipe=recipe,
            )
        w_fp8, w_scale = quantize_weight(
            weight_hp,
            fp8_dtype(recipe.fp8_format),
            recipe.weight_granularity,
            recipe.block_size,
            name=f"{module_name or 'linear'}.weight",
            scale_method=recipe.weight_scale_method,
        )
        new.weight = nn.Parameter(w_fp8.contiguous(), requires_grad=False)  # Conv1D: a .t() view
        new.weight_scale = nn.Parameter(w_scale, requires_grad=False)
        if linear.bias is not None:
            new.bias = nn.Parameter(
                linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad
            )
        if input_scale is not None:
            new.set_input_scale(input_scale)
        if module_name:
            new.__dict__["fp8_name"] = module_name  # named in warnings
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(input)
        if dtype is not None:
            # nn.Linear under torch.autocast runs (and returns) the autocast dtype: so does
            # this layer (R38 F2), with autocast off inside, so that its own fp32 matmuls
            # (the overflow redo, fp32 products of bf16 operands) stay fp32
            with torch.autocast(input.device.type, enabled=False):
                return self._forward(input.to(dtype))
        return self._forward(input)

    def _forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype in _FP8_DTYPES:
            name = self.__dict__.get("fp8_name")
            raise TypeError(
                f"{f'Fp8Linear {name}' if name else 'Fp8Linear'}: the input is "
                f"{str(input.dtype).removeprefix('torch.')}; FP8 layers take activations in "
                f"their compute dtype ({str(self.compute_dtype).removeprefix('torch.')}) and "
                "quantize them themselves: cast the inputs to the compute dtype (a model that casts "
                "them to model.dtype needs hf_fp8's compute_dtype patch: hf_fp8.patches.status())"
            )
        if torch.is_grad_enabled():
            check_frozen(self, ("weight", "weight_scale", "input_scale"))
        bias = self.bias
        if bias is not None and bias.dtype != input.dtype and input.is_floating_point():
            bias = bias.to(input.dtype)
        if 0 in self.weight.shape and input.is_floating_point() and input.dim() > 0:
            # nn.Linear(0, n) (zeros + bias) or nn.Linear(k, 0) (an empty output), as
            # nn.Linear computes them: nothing to quantize or multiply (R24 F3)
            return nn.functional.linear(input, input.new_zeros(self.weight.shape), bias)
        scale = self.input_scale
        if scale is None and self._plan.static:
            name = self.__dict__.get("fp8_name")
            key = repr(name) if name else "'<module name>'"
            raise RuntimeError(
                f"static FP8 layer {name or '(unnamed)'} has no input_scale: calibrate it with "
                "hf_fp8.calibrate(model, batches), or give Fp8Config('static', "
                f"activation_scale=...) (every layer) or activation_scales={{{key}: ...}} "
                "(this layer)"
            )
        if scale is not None and self._plan.static and not torch.compiler.is_compiling():
            self._count_saturation(input, scale)
        return fp8_linear(
            input, self.weight, self.weight_scale, bias, plan=self._plan,
            input_scale=self.input_scale,
        )  # fmt: skip

    def _count_saturation(self, x: torch.Tensor, scale: torch.Tensor) -> None:
        """Eager only: count the activations the static scale clips (one warning when often)."""
        counter = self.__dict__.get("_saturation")
        if counter is None:
            counter = self.__dict__["_saturation"] = SaturationCounter()
        if not (x.is_floating_point() and x.shape[-1:] == self.weight.shape[-1:]):
            return  # fp8_linear raises its own error for these
        counter.update(x, scale, fp8_max(self.weight.dtype), self.__dict__.get("fp8_name", ""))

    def saturation_fraction(self) -> float:
        """Fraction of the activations this static layer clipped so far (eager calls)."""
        counter = self.__dict__.get("_saturation")
        return 0.0 if counter is None else counter.fraction()

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(
            self.weight,
            self.weight_scale,
            dtype or self.compute_dtype,
            self.weight_granularity,
            self.block_size,
        )

    def dequantize(self) -> nn.Linear:
        """A plain ``nn.Linear`` in ``compute_dtype`` holding the dequantized weight."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, self.bias is not None)
        linear.weight = nn.Parameter(self.dequantize_weight())
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(self.compute_dtype).clone())
        return linear

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` / ``.half()`` change the compute dtype and bias, never fp8 or scales."""
        frozen = [p for p in (self.weight, self.weight_scale, self.input_scale) if p is not None]

        def keep_storage_dtype(t: torch.Tensor) -> torch.Tensor:
            if any(t is p for p in frozen):
                probe = fn(t.detach()[:0])  # where and in what dtype fn would put t
                if probe.dtype != t.dtype:  # a dtype cast: move only
                    return t.to(device=probe.device)
            return fn(t)  # device moves, to_empty, ...

        compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        refuse_fp8_compute_dtype(self, compute_dtype)
        self.compute_dtype = compute_dtype
        return super()._apply(keep_storage_dtype, recurse)

    def _check_state(self, state_dict: dict[str, torch.Tensor], prefix: str) -> None:
        """The checks of a checkpoint load (hf_fp8.numerics.checks), on ``load_state_dict``
        too: fp8 dtype and shape of the weight, float32 / finite / positive / bounded scales
        of the right shape. The weight's codes are not scanned here (one pass per byte)."""
        dtype = fp8_dtype(self.fp8_format)
        bound = max_scale(dtype, self.compute_dtype)
        weight = state_dict.get(prefix + "weight")
        if weight is not None:
            shape = (self.out_features, self.in_features)
            check_fp8_tensor(
                prefix + "weight", weight, dtype=dtype, shape=shape, check_values=False
            )
        scale = state_dict.get(prefix + "weight_scale")
        if scale is not None:
            shape = weight_scale_shape(
                self.out_features, self.in_features, self.weight_granularity, self.block_size
            )
            check_scale_tensor(prefix + "weight_scale", scale, shape=shape, max_value=bound)
        scale = state_dict.get(prefix + "input_scale")
        if scale is not None:
            check_scale_tensor(
                prefix + "input_scale",
                scale,
                shape=(1,),
                max_value=bound,
                min_value=min_input_scale(dtype),
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        weight = state_dict.get(prefix + "weight")
        if weight is not None and not is_fp8(weight.dtype):
            raise ValueError(
                f"{prefix}weight is {weight.dtype}, not fp8: this is a high-precision state "
                "dict; quantize it with Fp8Linear.from_linear or hf_fp8.quantize_model instead"
            )
        self._check_state(state_dict, prefix)
        for name in ("weight_scale", "input_scale"):
            scale = state_dict.get(prefix + name)
            if scale is not None and scale.dim() == 0:  # AutoFP8 / vLLM "fp8" scalar scales
                state_dict[prefix + name] = scale.reshape(1)
        scale = state_dict.get(prefix + "input_scale")
        if scale is not None and self.input_scale is None and self.recipe.is_static:
            self.input_scale = nn.Parameter(
                torch.empty(1, dtype=torch.float32, device=self.weight.device), requires_grad=False
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        act = (
            f"{str(self.compute_dtype).removeprefix('torch.')} (weight-only)"
            if not self.recipe.quantizes_activations
            else f"{self.fp8_format}/{self.activation_granularity}"
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.activation_scheme}, "
            f"weight={self.fp8_format}/{self.weight_granularity}, activation={act}, "
            f"compute_dtype={self.compute_dtype}, kernel={self.kernel}"
        )
