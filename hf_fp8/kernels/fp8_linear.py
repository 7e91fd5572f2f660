"""The one FP8 linear entry point: pick the gemm, quantize the activation, run it.

Gradients: the fp8 weight and its scales get none; the input (and bias) get the
straight-through gradient ``grad_x = grad_out @ dequantize(w)``: activation rounding is
invisible to autograd. Forward numbers are the same with and without autograd.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hf_fp8.kernels import compiled
from hf_fp8.kernels.cpu_linear import functorch_active
from hf_fp8.kernels.emulated import (
    _mm_forward,
    _quantize_act,
    decode_weight,
    emulated_linear,
    post_scaled,
)
from hf_fp8.kernels.scaled_mm import scaled_mm_linear, unsupported_reason
from hf_fp8.numerics import dequantize
from hf_fp8.numerics.formats import fp8_dtype, fp8_format_of
from hf_fp8.recipe import (
    ActivationGranularity,
    ActivationScheme,
    Fp8Recipe,
    Granularity,
    Kernel,
    parse,
)

# Plain strings (the recipe's words): compared per call, also under torch.compile.
_EMULATED, _SCALED_MM = Kernel.EMULATED.value, Kernel.SCALED_MM.value


def quantize_activation(
    x_hp: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str | ActivationGranularity,
    input_scale: torch.Tensor | None,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 activation ``[..., K]`` and its scale: static when ``input_scale`` is given
    (per tensor), else dynamic with ``granularity`` ``"tensor"``, ``"token"`` or ``"block"``
    (``1 × block_k``). A compiled single pass where inductor is available."""
    layout = parse(ActivationGranularity, granularity, "activation granularity").layout
    gran = Granularity.TENSOR.value if input_scale is not None else layout.value
    return compiled.run(
        _quantize_act, x_hp, input_scale, act_dtype=fp8_dtype, gran=gran, bk=int(block_k)
    )


@dataclass(frozen=True)
class LinearPlan:
    """Everything static about one FP8 linear layer, derived once from its ``Fp8Recipe``.

    Plain strings and dtypes (no enums): it is a constant to ``torch.compile`` and a key of
    the compiled helpers. ``kernel`` is the request; the gemm is chosen per call from the
    input's device and dtype (:func:`fp8_linear`).
    """

    kernel: str  # Kernel word: "auto" | "scaled_mm" | "emulated"
    weight_granularity: str  # numerics layout: "tensor" | "row" | "block"
    block_size: tuple[int, int]
    act_dtype: torch.dtype | None  # None: weight-only
    act_granularity: str | None  # numerics layout ("row" for per-token)
    static: bool

    @classmethod
    def from_recipe(cls, recipe: Fp8Recipe) -> LinearPlan:
        quantized = recipe.quantizes_activations
        return cls(
            kernel=recipe.kernel.value,
            weight_granularity=recipe.weight_granularity.value,
            block_size=recipe.block_size,
            act_dtype=fp8_dtype(recipe.fp8_format) if quantized else None,
            act_granularity=recipe.activation_layout.value if quantized else None,
            static=recipe.is_static,
        )


@functools.lru_cache(maxsize=256)
def _plan_from_words(
    activation_scheme: str,
    activation_granularity: str | None,
    weight_granularity: str,
    block_size: tuple[int, int],
    fp8_format: str,
    kernel: str,
) -> LinearPlan:
    if activation_scheme == ActivationScheme.STATIC:
        activation_granularity = None  # static scales are per tensor, whatever was passed
    elif activation_scheme == ActivationScheme.WEIGHT_ONLY:
        activation_granularity = None
    recipe = Fp8Recipe.resolve(
        activation_scheme,
        weight_granularity=weight_granularity,
        activation_granularity=activation_granularity,
        fp8_format=fp8_format,
        block_size=block_size,
        kernel=kernel,
    )
    return LinearPlan.from_recipe(recipe)


_AUTOCAST_DEVICES = ("cpu", "cuda")
_AUTOCAST_INPUTS = (torch.float32, torch.float16, torch.bfloat16)  # as autocast's casts


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """``None`` where CPU / CUDA ``torch.autocast`` is off for ``x``; else the dtype it runs
    ``F.linear`` in: the autocast dtype, or ``x.dtype`` for an input it leaves alone
    (float64; an fp8 input, refused later). FP8 layers then cast their input to it and run
    with autocast off inside, so that their own fp32 matmuls stay fp32 (R38 F2)."""
    device = x.device.type
    if device not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device) if x.dtype in _AUTOCAST_INPUTS else x.dtype


def _choose_gemm(plan: LinearPlan, x: torch.Tensor, w_fp8: torch.Tensor) -> bool:
    """True: ``torch._scaled_mm``; False: the emulation. Raises for an impossible
    ``kernel="scaled_mm"``."""
    if plan.act_dtype is None or plan.kernel == _EMULATED:
        return False
    reason = unsupported_reason(
        x.device, x.dtype, plan.act_dtype, w_fp8.dtype, plan.act_granularity,
        plan.weight_granularity,
    )  # fmt: skip
    if reason is not None and plan.kernel == _SCALED_MM:
        raise RuntimeError(
            f"kernel='scaled_mm' cannot run here: {reason}. Use kernel='auto' (or "
            "'emulated') to run the FP8 emulation instead: from_pretrained(..., "
            "quantization_config=Fp8Config(kernel='auto')) for a loaded model, "
            "Fp8Config(..., kernel='auto') when quantizing, or layer.kernel = 'auto'."
        )
    return reason is None


def _forward(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    plan: LinearPlan,
    use_scaled_mm: bool,
) -> torch.Tensor:
    if functorch_active():
        return _functorch_forward(x, w_fp8, w_scale, bias, input_scale, plan)
    if use_scaled_mm:
        a_fp8, a_scale = compiled.run(
            _quantize_act,
            x,
            input_scale,
            act_dtype=plan.act_dtype,
            gran=plan.act_granularity,
            bk=plan.block_size[1],
        )
        return scaled_mm_linear(a_fp8, a_scale, w_fp8, w_scale, bias, x.dtype)
    return emulated_linear(
        x,
        w_fp8,
        w_scale,
        bias,
        plan.weight_granularity,
        plan.block_size,
        act_dtype=plan.act_dtype,
        act_granularity=plan.act_granularity,
        input_scale=input_scale,
    )


def _functorch_forward(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    plan: LinearPlan,
) -> torch.Tensor:
    """The emulation in plain torch ops, for tensors of a ``torch.func`` transform (``vmap``'s
    batched tensors have no storage for the C kernels, and no compile or host read may run
    under it). Same operands and scale placement as the compiled emulation's matmul path;
    the overflow fallback (R24 F2) is a per-row select instead of a host check."""
    dtype = x.dtype
    post = post_scaled(plan.weight_granularity, dtype) or (
        plan.act_dtype is not None and post_scaled(plan.act_granularity, dtype)
    )

    def run(post: bool) -> torch.Tensor:
        return _mm_forward(
            x, w_fp8, w_scale, bias, input_scale,
            w_gran=plan.weight_granularity,
            block_size=plan.block_size,
            act_dtype=plan.act_dtype,
            a_gran=plan.act_granularity,
            w_post=post and post_scaled(plan.weight_granularity, dtype),
            a_post=post and plan.act_dtype is not None and post_scaled(plan.act_granularity, dtype),
        )  # fmt: skip

    if not post:
        return run(False)
    out = run(True)
    redo = ~out.isfinite().all(-1) & x.isfinite().all(-1)  # as emulated._redo_rows
    return torch.where(redo.unsqueeze(-1), run(False), out)


INFERENCE_WEIGHTS_FIX = (
    "create or load the model outside torch.inference_mode() (torch.no_grad() is as fast "
    "under torch.compile), or, outside it, replace them by normal tensors before compiling: "
    "with torch.no_grad(): for m in model.modules(): if isinstance(m, hf_fp8.Fp8Linear): "
    "m.weight = torch.nn.Parameter(m.weight.clone(), requires_grad=False); "
    "m.weight_scale = torch.nn.Parameter(m.weight_scale.clone(), requires_grad=False)"
)


@torch.library.custom_op("hf_fp8::saved_weight_scale", mutates_args=())
def saved_weight_scale(w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """A copy of ``w_scale`` (per-row / per-block scales: small), after checking at run time
    that a compiled graph can save the weights for backward. Inside ``torch.compile``
    ``tensor.is_inference()`` cannot be traced; this opaque op (no graph break) checks the
    real tensors, so that weights created under ``torch.inference_mode()`` raise this error
    instead of torch's "Inference tensors cannot be saved for backward" (R34 F11)."""
    if w_fp8.is_inference() or w_scale.is_inference():
        raise RuntimeError(
            f"Fp8Linear (weight {tuple(w_fp8.shape)}): its weights were created under "
            "torch.inference_mode() (inference tensors) and a torch.compile'd backward "
            "cannot save them (eager training can: it reads them back at backward). "
            f"Fix: {INFERENCE_WEIGHTS_FIX}"
        )
    return w_scale.clone()


@saved_weight_scale.register_fake
def _(w_fp8, w_scale):
    return torch.empty_like(w_scale)


class _Fp8LinearFunction(torch.autograd.Function):
    """FP8 forward; straight-through backward in the compute dtype.

    New-style (``setup_context``, ``generate_vmap_rule``) so that ``torch.func`` transforms
    (``grad``, ``jacrev``, ``vjp``, ``vmap``) run it (R31 F7). The backward is made of
    differentiable ops on ``grad_out`` (``grad_out @ W``, ``grad_out.sum(0)``) with the
    dequantized weight a constant, so double backward works as for ``nn.Linear`` with a
    frozen weight (R31 F12). The fp8 codes are kept only when the input needs a gradient
    (R31 F11: a model loaded under ``inference_mode`` holds inference tensors, which autograd
    cannot save; they are frozen and cannot change outside inference mode, so they are kept
    on ``ctx`` unchecked then)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w_fp8, w_scale, bias, input_scale, plan, use_scaled_mm):  # type: ignore[override]
        return _forward(x, w_fp8, w_scale, bias, input_scale, plan, use_scaled_mm)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        _, w_fp8, w_scale, _, _, plan, _ = inputs
        ctx.plan = plan
        ctx.inference_weights = None
        if not ctx.needs_input_grad[0]:
            return
        if not torch.compiler.is_compiling() and (w_fp8.is_inference() or w_scale.is_inference()):
            ctx.inference_weights = (w_fp8, w_scale)
        else:
            ctx.save_for_backward(w_fp8, w_scale)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        plan: LinearPlan = ctx.plan
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w_fp8, w_scale = ctx.inference_weights or ctx.saved_tensors
            args = (w_fp8, w_scale, grad_out.dtype, plan.weight_granularity, plan.block_size)
            # under torch.func: eager torch ops (no C decode, no compile)
            w = dequantize(*args) if functorch_active() else decode_weight(*args)
            grad_x = grad_out @ w
        if ctx.needs_input_grad[3]:
            grad_bias = grad_out.sum(0)
        return grad_x, None, None, grad_bias, None, None, None


def fresh_output(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` (this call's own result, aliased by nothing else) in ``shape``, never a view
    (R25 F7): ``nn.Linear``'s 2-D output is not one, and FSDP2 warns that an in-place op
    (``out += residual``) on a view output of a sharded module drops its pre-backward hook.
    ``aten._unsafe_view`` is what ``matmul`` uses to fold its batch dims: the same storage,
    no copy, autograd's ``view`` backward, not marked as a view."""
    if out._base is None and tuple(out.shape) == tuple(shape):
        return out
    if not out.is_contiguous():  # strides a view cannot express: reshape copies anyway
        out = out.contiguous()
    return torch.ops.aten._unsafe_view(out, shape)


def fp8_linear(
    x_hp: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    plan: LinearPlan | None = None,
    input_scale: torch.Tensor | None = None,
    activation_scheme: str = "dynamic",
    activation_granularity: str | None = "token",
    weight_granularity: str = "row",
    block_size: tuple[int, int] = (128, 128),
    activation_dtype: torch.dtype | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """FP8 ``linear``: ``x_hp @ W.T + bias`` with ``W ≈ w_fp8 * w_scale``, in ``x_hp.dtype``.

    ``plan`` (``LinearPlan.from_recipe(recipe)``, built once per layer, as ``Fp8Linear``
    does) says everything static; nothing in it is re-validated per call. Without a plan the
    words below are resolved once into a cached plan (``Fp8Recipe`` errors name the accepted
    values): ``activation_scheme`` ``"dynamic"`` (``activation_granularity`` ``"token"``,
    ``"tensor"`` or ``"block"``), ``"static"`` (per-tensor ``input_scale``) or
    ``"weight_only"``; ``kernel`` ``"auto"`` (``torch._scaled_mm`` where the GPU and the
    scaling allow it, emulation elsewhere), ``"scaled_mm"`` (raise if impossible) or
    ``"emulated"``; the activation format is ``activation_dtype`` or the weight's.
    ``bias`` must already be in ``x_hp.dtype``. ``x_hp`` may have any number of leading dims.
    """
    if plan is None:
        fmt = fp8_format_of(activation_dtype or w_fp8.dtype)
        plan = _plan_from_words(
            activation_scheme, activation_granularity, weight_granularity,
            (int(block_size[0]), int(block_size[1])), fmt.value, kernel,
        )  # fmt: skip
    if w_fp8.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(
            f"FP8 linear expects fp8 weight codes (float8_e4m3fn / float8_e5m2), got "
            f"{w_fp8.dtype}: something cast the stored codes. With FSDP2 and a "
            "MixedPrecisionPolicy(param_dtype=...), shard the FP8 modules with "
            "hf_fp8.fully_shard_fp8(model) first (accelerate's FSDP2 does it through hf_fp8's "
            "patch); to compute in high precision, load with Fp8Config(dequantize=True)"
        )
    if not x_hp.is_floating_point():
        raise RuntimeError(
            f"FP8 linear expects a floating-point input (bfloat16, float16 or float32), got "
            f"{x_hp.dtype}: cast it first, as nn.Linear requires"
        )
    if x_hp.dim() == 0 or x_hp.shape[-1] != w_fp8.shape[-1]:
        raise RuntimeError(
            f"input of shape {tuple(x_hp.shape)} cannot multiply a weight of shape "
            f"{tuple(w_fp8.shape)}: the last input dim must be in_features={w_fp8.shape[-1]}"
        )
    if not plan.static:
        input_scale = None
    elif input_scale is None:
        raise RuntimeError(
            "this static FP8 layer has no input_scale: calibrate it with "
            "hf_fp8.calibrate(model, batches), or give Fp8Config('static', activation_scale=...) "
            "(every layer) or activation_scales={'<module name>': ...} (per layer)"
        )
    use_scaled_mm = _choose_gemm(plan, x_hp, w_fp8)

    lead, k = x_hp.shape[:-1], x_hp.shape[-1]
    x = x_hp.reshape(lead.numel(), k)  # -1 is ambiguous for K = 0 (nn.Linear(0, n))
    if x.shape[0] == 0:  # nothing to quantize: an empty (autograd-connected) result
        out = torch.nn.functional.linear(x, x.new_zeros(w_fp8.shape[0], k), bias)
        return fresh_output(out, (*lead, w_fp8.shape[0]))
    tensors = (x, w_fp8, w_scale, bias, input_scale)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        if (
            torch.compiler.is_compiling()
            and x.requires_grad  # the weights are saved for backward
            and not (w_fp8.requires_grad or w_scale.requires_grad)
        ):
            w_scale = saved_weight_scale(w_fp8, w_scale)  # a clear error for inference weights
        out = _Fp8LinearFunction.apply(x, w_fp8, w_scale, bias, input_scale, plan, use_scaled_mm)
    else:
        out = _forward(x, w_fp8, w_scale, bias, input_scale, plan, use_scaled_mm)
    return fresh_output(out, (*lead, w_fp8.shape[0]))
