"""The one FP8 linear entry point: pick the gemm, quantize the activation, run it.

Gradients: the fp8 weight and its scales get none; the input (and bias) get the
straight-through gradient ``grad_x = grad_out @ dequantize(w)``: activation rounding is
invisible to autograd. Forward numbers are the same with and without autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_fp8.kernels import compiled
from hf_fp8.kernels.capability import check_kernel
from hf_fp8.kernels.emulated import _quantize_act, decode_weight, emulated_linear
from hf_fp8.kernels.scaled_mm import scaled_mm_linear, unsupported_reason

ACTIVATION_SCHEMES = ("dynamic", "static", "weight_only")
# activation granularity -> numerics granularity
_ACT_TO_NUMERICS = {"tensor": "tensor", "token": "row", "block": "block"}


def quantize_activation(
    x_hp: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str,
    input_scale: torch.Tensor | None,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 activation ``[..., K]`` and its scale: static when ``input_scale`` is given
    (per tensor), else dynamic with ``granularity`` ``"tensor"``, ``"token"`` or ``"block"``
    (``1 × block_k``). A compiled single pass where inductor is available."""
    if granularity not in _ACT_TO_NUMERICS:
        raise ValueError(
            f"activation granularity={granularity!r} is not supported; use one of "
            f"{tuple(_ACT_TO_NUMERICS)}"
        )
    gran = "tensor" if input_scale is not None else _ACT_TO_NUMERICS[granularity]
    return compiled.run(
        _quantize_act, x_hp, input_scale, act_dtype=fp8_dtype, gran=gran, bk=int(block_k)
    )


@dataclass(frozen=True)
class _Plan:
    """Everything static about one FP8 linear call."""

    kernel: str  # "scaled_mm" | "emulated"
    weight_granularity: str
    block_size: tuple[int, int]
    act_dtype: torch.dtype | None  # None: weight-only
    act_granularity: str | None  # numerics name: "tensor" | "row" | "block"


def _forward(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    plan: _Plan,
) -> torch.Tensor:
    if plan.kernel == "scaled_mm":
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


class _Fp8LinearFunction(torch.autograd.Function):
    """FP8 forward; straight-through backward in the compute dtype."""

    @staticmethod
    def forward(ctx, x, w_fp8, w_scale, bias, input_scale, plan):  # type: ignore[override]
        ctx.save_for_backward(w_fp8, w_scale)
        ctx.plan = plan
        return _forward(x, w_fp8, w_scale, bias, input_scale, plan)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        w_fp8, w_scale = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = decode_weight(
                w_fp8, w_scale, grad_out.dtype, plan.weight_granularity, plan.block_size
            )
            grad_x = grad_out @ w
        if ctx.needs_input_grad[3]:
            grad_bias = grad_out.sum(0)
        return grad_x, None, None, grad_bias, None, None


def fp8_linear(
    x_hp: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation_scheme: str = "dynamic",
    activation_granularity: str | None = "token",
    weight_granularity: str = "row",
    block_size: tuple[int, int] = (128, 128),
    input_scale: torch.Tensor | None = None,
    activation_dtype: torch.dtype | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """FP8 ``linear``: ``x_hp @ W.T + bias`` with ``W ≈ w_fp8 * w_scale``, in ``x_hp.dtype``.

    ``activation_scheme``: ``"dynamic"`` (scale per call, ``activation_granularity``
    ``"token"``, ``"tensor"`` or ``"block"``), ``"static"`` (per-tensor ``input_scale``),
    ``"weight_only"`` (activations stay in high precision). ``kernel``: ``"auto"``
    (``torch._scaled_mm`` where the GPU and the scaling allow it, emulation elsewhere),
    ``"scaled_mm"`` (raise if impossible) or ``"emulated"``. ``bias`` must already be in
    ``x_hp.dtype``. ``x_hp`` may have any number of leading dims.
    """
    check_kernel(kernel)
    if x_hp.dim() == 0 or x_hp.shape[-1] != w_fp8.shape[-1]:
        raise RuntimeError(
            f"input of shape {tuple(x_hp.shape)} cannot multiply a weight of shape "
            f"{tuple(w_fp8.shape)}: the last input dim must be in_features={w_fp8.shape[-1]}"
        )
    if activation_scheme not in ACTIVATION_SCHEMES:
        raise ValueError(
            f"activation_scheme={activation_scheme!r} is not supported; use one of "
            f"{ACTIVATION_SCHEMES}"
        )
    block_size = (int(block_size[0]), int(block_size[1]))
    if activation_scheme == "weight_only":
        if kernel == "scaled_mm":
            raise ValueError(
                "kernel='scaled_mm' needs FP8 activations; activation_scheme='weight_only' "
                "dequantizes the weight instead: use kernel='auto' or 'emulated'"
            )
        plan = _Plan("emulated", weight_granularity, block_size, None, None)
    else:
        if activation_scheme == "static":
            if input_scale is None:
                raise RuntimeError(
                    "this static FP8 layer has no input_scale: calibrate it with "
                    "hf_fp8.calibrate(model, batches), or give "
                    "Fp8Config('static', activation_scale=...)"
                )
            a_gran = "tensor"
        else:
            if activation_granularity not in _ACT_TO_NUMERICS:
                raise ValueError(
                    f"activation_granularity={activation_granularity!r} is not supported for "
                    f"dynamic activations; use one of {tuple(_ACT_TO_NUMERICS)}"
                )
            a_gran = _ACT_TO_NUMERICS[activation_granularity]
            input_scale = None
        act_dtype = activation_dtype or w_fp8.dtype
        reason = unsupported_reason(
            x_hp.device, x_hp.dtype, act_dtype, w_fp8.dtype, a_gran, weight_granularity
        )
        if kernel == "scaled_mm" and reason is not None:
            raise RuntimeError(
                f"kernel='scaled_mm' cannot run here: {reason}. Use kernel='auto' (or "
                "'emulated') to run the FP8 emulation instead."
            )
        chosen = "scaled_mm" if kernel != "emulated" and reason is None else "emulated"
        plan = _Plan(chosen, weight_granularity, block_size, act_dtype, a_gran)

    lead, k = x_hp.shape[:-1], x_hp.shape[-1]
    x = x_hp.reshape(-1, k)
    if x.shape[0] == 0:  # nothing to quantize: an empty (autograd-connected) result
        out = torch.nn.functional.linear(x, x.new_zeros(w_fp8.shape[0], k), bias)
        return out.reshape(*lead, w_fp8.shape[0])
    tensors = (x, w_fp8, w_scale, bias, input_scale)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        out = _Fp8LinearFunction.apply(x, w_fp8, w_scale, bias, input_scale, plan)
    else:
        out = _forward(x, w_fp8, w_scale, bias, input_scale, plan)
    return out.reshape(*lead, w_fp8.shape[0])
