"""The one FP8 linear entry point: quantize the activation, pick the gemm, run it."""

from __future__ import annotations

import torch

from hf_fp8.kernels.capability import check_kernel
from hf_fp8.kernels.emulated import emulated_linear
from hf_fp8.kernels.scaled_mm import scaled_mm_linear, unsupported_reason
from hf_fp8.numerics import dequantize, quantize, quantize_with_scale

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
    """fp8 activation and its scale: static when ``input_scale`` is given, else dynamic."""
    gran = _ACT_TO_NUMERICS[granularity]
    if input_scale is not None:
        return quantize_with_scale(x_hp, input_scale, fp8_dtype), input_scale
    return quantize(x_hp, fp8_dtype, gran, (1, block_k))


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

    ``activation_scheme``: ``"dynamic"`` (scale per call), ``"static"`` (``input_scale``),
    ``"weight_only"`` (activations stay in high precision). ``kernel``: ``"auto"``
    (``torch._scaled_mm`` where the GPU and scaling allow it, emulation elsewhere),
    ``"scaled_mm"`` (raise if impossible) or ``"emulated"``.
    """
    check_kernel(kernel)
    if activation_scheme == "weight_only":
        if kernel == "scaled_mm":
            raise ValueError(
                "kernel='scaled_mm' needs FP8 activations; activation_scheme='weight_only' "
                "dequantizes the weight instead: use kernel='auto' or 'emulated'"
            )
        return emulated_linear(x_hp, w_fp8, w_scale, bias, weight_granularity, block_size)
    if activation_scheme not in ACTIVATION_SCHEMES:
        raise ValueError(
            f"activation_scheme={activation_scheme!r} is not supported; use one of "
            f"{ACTIVATION_SCHEMES}"
        )
    if activation_scheme == "static" and input_scale is None:
        raise RuntimeError(
            "this static FP8 layer has no input_scale: calibrate it with "
            "hf_fp8.calibrate(model, batches), or give Fp8Config('static', activation_scale=...)"
        )
    act_dtype = activation_dtype or w_fp8.dtype
    a_gran = "tensor" if activation_scheme == "static" else activation_granularity
    a_fp8, a_scale = quantize_activation(
        x_hp,
        act_dtype,
        a_gran,
        input_scale if activation_scheme == "static" else None,
        block_size[1],
    )

    reason = unsupported_reason(
        x_hp.device,
        x_hp.dtype,
        act_dtype,
        w_fp8.dtype,
        _ACT_TO_NUMERICS[a_gran],
        weight_granularity,
    )
    if kernel == "scaled_mm" and reason is not None:
        raise RuntimeError(f"kernel='scaled_mm' cannot run here: {reason}. Use kernel='auto'.")
    if kernel != "emulated" and reason is None:
        out = scaled_mm_linear(
            a_fp8.reshape(-1, a_fp8.shape[-1]),
            a_scale.reshape(-1, 1) if a_scale.numel() > 1 else a_scale,
            w_fp8,
            w_scale,
            bias,
            x_hp.dtype,
        )
        return out.reshape(*x_hp.shape[:-1], w_fp8.shape[0])

    a_hp = dequantize(a_fp8, a_scale, x_hp.dtype, _ACT_TO_NUMERICS[a_gran], (1, block_size[1]))
    if x_hp.requires_grad and torch.is_grad_enabled():
        # straight-through estimator: the rounding is invisible to the gradient
        a_hp = x_hp + (a_hp - x_hp).detach()
    return emulated_linear(a_hp, w_fp8, w_scale, bias, weight_granularity, block_size)
