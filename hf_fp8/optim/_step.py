"""Per-tensor AdamW steps used by :class:`hf_fp8.optim.AdamWFp8` (functions, no state).

* :func:`grouped_step`: the quantized step on ``[groups, group_size]`` views, written with
  plain fp32 torch operations (the reference; ``torch.compile`` of it is a fast path and the
  C kernel in :mod:`hf_fp8.optim._cpu_kernel` mirrors it bit for bit).
* :func:`fp32_step`: AdamW with fp32 states for tensors that are not quantized, with the
  same foreach operations as ``torch.optim.AdamW(foreach=True)``.

Hyper-parameters of the quantized step travel as one fp32 tensor (:func:`hyperparams`) so
that a compiled step never recompiles when the learning rate changes (float64 for float64
weights, whose decay and update are applied in float64: :func:`apply_update`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hf_fp8.numerics import log_moments
from hf_fp8.numerics.coat import dequantize_groups, quantize_groups, random_bits

# Order of the fields of the hyper-parameter tensor: the one table, shared with the C kernel
# (passed to it as HP_* defines) and the compiled step.
HP_FIELDS = ("decay", "step_size", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "inv_bc2")


def hp_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """dtype of the hyper-parameter tensor for a parameter of ``param_dtype``: float64 for
    float64 weights (their decay factor is applied in float64), else fp32."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def hyperparams(
    group: dict, step: float, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Tensor of :data:`HP_FIELDS` for one step of ``group``, in ``dtype`` (:func:`hp_dtype`).

    ``decay = 1 - lr·wd``, ``step_size = lr / (1 - β1^t)``, ``inv_bc2 = 1 / sqrt(1 - β2^t)``,
    computed in float64 (a tensor ``lr`` stays on its device: no host sync). The steps use
    every field but ``decay`` in fp32 whatever ``dtype`` is (:func:`split_hyperparams`).
    """
    beta1, beta2 = group["betas"]
    bc1 = 1.0 - beta1**step
    lr, wd = group["lr"], group["weight_decay"]
    values: dict[str, object] = {
        "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "eps": group["eps"],
        "inv_bc2": 1.0 / math.sqrt(1.0 - beta2**step),
    }
    if isinstance(lr, torch.Tensor):
        lr64 = lr.detach().reshape(()).to(device=device, dtype=torch.float64)
        values.update(decay=1.0 - lr64 * wd, step_size=lr64 / bc1)
        parts = [
            v
            if isinstance(v, torch.Tensor)
            else torch.tensor(v, dtype=torch.float64, device=device)
            for v in (values[name] for name in HP_FIELDS)
        ]
        return torch.stack(parts).to(dtype)
    values.update(decay=1.0 - lr * wd, step_size=lr / bc1)
    return torch.tensor([values[name] for name in HP_FIELDS], dtype=dtype, device=device)


def split_hyperparams(hp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(decay, fields)``: ``decay`` in ``hp``'s dtype, ``fields`` every field in fp32 (for an
    fp32 ``hp``, exactly its values)."""
    return hp[HP_FIELDS.index("decay")], dict(zip(HP_FIELDS, hp.float().unbind(0), strict=True))


def apply_update(param: torch.Tensor, decay: torch.Tensor, update: torch.Tensor) -> None:
    """``param ← param·decay − update`` in place (``update`` fp32).

    fp32 and narrower weights: computed in fp32 and rounded once (the C kernel's order and
    rounding). float64 weights: decay and update applied in float64, as
    ``torch.optim.AdamW`` does, so the weight is never rounded to fp32.
    """
    if param.dtype == torch.float64:
        param.mul_(decay).sub_(update.to(param.dtype))
    else:
        param.copy_(param.float() * decay - update)


def grouped_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_q: torch.Tensor,
    m_scale: torch.Tensor,
    m_exp: torch.Tensor | None,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
    v_exp: torch.Tensor | None,
    hp: torch.Tensor,
    keys: torch.Tensor | None = None,
    sqrt_v: bool = False,
    sr_m: bool = False,
    sr_v: bool = False,
    log: bool = False,
) -> None:
    """One AdamW step on ``[G, group_size]`` tensors with quantized moments, in place.

    ``log``: ``moment_format="log"`` (:func:`grouped_step_log`; ``m_exp`` is ``None``).

    ``m_q`` / ``v_q``: fp8 codes ``[G, group_size]``; ``*_scale`` / ``*_exp``: fp32 ``[G]``
    (``*_exp`` is ``None`` without dynamic range expansion). ``sqrt_v``: the second moment is
    stored as ``sqrt(v)``. ``sr_m`` / ``sr_v``: stochastic rounding of that moment, with the
    int64 stream keys ``keys = [key_m, key_v]`` (see :func:`hf_fp8.numerics.coat.random_bits`).
    Every operation is fp32 and in the order the C kernel uses.
    """
    if log:
        grouped_step_log(
            param, grad, m_q, m_scale, v_q, v_scale, v_exp, hp, keys=keys, sr_m=sr_m, sr_v=sr_v
        )
        return
    decay, h = split_hyperparams(hp)
    step_size, w1, beta2 = h["step_size"], h["one_minus_beta1"], h["beta2"]
    w2, eps, inv_bc2 = h["one_minus_beta2"], h["eps"], h["inv_bc2"]
    g = grad.float()
    m = dequantize_groups(m_q, m_scale, m_exp)
    v = dequantize_groups(v_q, v_scale, v_exp)
    if sqrt_v:
        v = v * v
    m = m + w1 * (g - m)
    v = v * beta2 + w2 * g * g
    root = _sqrt_rn(v)
    denom = root * inv_bc2 + eps
    apply_update(param, decay, step_size * m / denom)
    expand = m_exp is not None
    stored_v = root if sqrt_v else v
    moments = ((m, m_q, m_scale, m_exp, sr_m, 0), (stored_v, v_q, v_scale, v_exp, sr_v, 1))
    for new, q, scale, exp, sr, which in moments:
        bits = None
        if sr:
            if keys is None:
                raise ValueError("stochastic rounding needs the stream keys")
            bits = random_bits(keys[which], new.shape)
        q_new, scale_new, exp_new = quantize_groups(
            new,
            q.dtype,
            dynamic_range_expansion=expand,
            stochastic_bits=bits,
            keep_nonzero=which == 1,  # a non-zero v never decodes to 0 (update m / eps)
        )
        q.copy_(q_new)
        scale.copy_(scale_new)
        if exp is not None and exp_new is not None:
            exp.copy_(exp_new)


def grouped_step_log(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
    v_exp: torch.Tensor,
    hp: torch.Tensor,
    keys: torch.Tensor | None = None,
    sr_m: bool = False,
    sr_v: bool = False,
) -> None:
    """The step of ``moment_format="log"`` (:mod:`hf_fp8.numerics.log_moments`), in place.

    ``m_q`` int8 / ``v_q`` uint8 codes ``[G, group_size]``; ``m_scale``, ``v_scale`` (``amax``
    of v) and ``v_exp`` (k) fp32 ``[G]``. v is requantized first: m is stored relative to the
    new ``v̂``. Every operation is fp32 / int32 and in the order of the C kernel."""
    decay, h = split_hyperparams(hp)
    step_size, w1, beta2 = h["step_size"], h["one_minus_beta1"], h["beta2"]
    w2, eps, inv_bc2 = h["one_minus_beta2"], h["eps"], h["inv_bc2"]
    g = grad.float()
    v_bits = log_moments.dequantize_v_bits(v_q, v_scale, v_exp)
    s, _ = log_moments.m_scales(v_q, v_scale, v_exp)
    m = log_moments.dequantize_m(m_q, m_scale, s)
    v = v_bits.view(torch.float32)
    m = m + w1 * (g - m)
    v = v * beta2 + w2 * g * g
    denom = _sqrt_rn(v) * inv_bc2 + eps
    apply_update(param, decay, step_size * m / denom)
    if (sr_m or sr_v) and keys is None:
        raise ValueError("stochastic rounding needs the stream keys")
    bits_v = log_moments.sr_bits(keys[1], v.shape) if sr_v else None
    vq, amax, k = log_moments.quantize_v(v, bits_v)
    _, s_inv = log_moments.m_scales(vq, amax, k)
    bits_m = log_moments.sr_bits(keys[0], m.shape) if sr_m else None
    mq, ms = log_moments.quantize_m(m * s_inv, bits_m)
    v_q.copy_(vq)
    v_scale.copy_(amax)
    v_exp.copy_(k)
    m_q.copy_(mq)
    m_scale.copy_(ms)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root on CPU, where torch's fp32 ``sqrt`` may be 1 ulp
    off: the float64 root rounded once to fp32 is exact, as is the C kernel's ``sqrtf``."""
    return x.double().sqrt().float() if x.device.type == "cpu" else x.sqrt()


def padded_groups(x: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """``x`` (``[rows, cols]``) zero-padded to whole groups and viewed as ``[G, group_size]``."""
    pad = (-cols) % group_size
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(-1, group_size)


def run_grouped(
    fn,
    param2d: torch.Tensor,
    grad2d: torch.Tensor,
    states: tuple[torch.Tensor | None, ...],
    hp: torch.Tensor,
    group_size: int,
    mark_dynamic: bool = False,
    **options,
) -> None:
    """Call ``fn`` (:func:`grouped_step` or a compiled version) on a ``[rows, cols]`` parameter.

    ``states`` are ``(m_q [rows, Cp], m_scale [rows, Gc], m_exp, v_q, v_scale, v_exp)``.
    Rows that do not fill whole groups are padded in temporary copies. ``options`` go to
    ``fn`` (``keys``, ``sqrt_v``, ``sr_m``, ``sr_v``).
    """
    rows, cols = param2d.shape
    m_q, m_scale, m_exp, v_q, v_scale, v_exp = states
    flat = [
        m_q.view(-1, group_size),
        m_scale.view(-1),
        None if m_exp is None else m_exp.view(-1),
        v_q.view(-1, group_size),
        v_scale.view(-1),
        None if v_exp is None else v_exp.view(-1),
    ]
    aligned = cols % group_size == 0 and param2d.is_contiguous()
    p = param2d.view(-1, group_size) if aligned else padded_groups(param2d, cols, group_size)
    g = padded_groups(grad2d, cols, group_size)
    if mark_dynamic:
        for t in (p, g, *flat):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
    fn(p, g, *flat, hp, **options)
    if not aligned:
        param2d.copy_(p.view(rows, -1)[:, :cols])


def fp32_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[float],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """AdamW on fp32 states with ``torch.optim.AdamW(foreach=True)``'s operations.

    ``params`` / ``grads`` may be bf16 / fp16 (computed in fp32 copies, rounded back once);
    float64 ``params`` are updated in float64 (the fp32 moments' update applied in float64,
    never a round trip of the weight through fp32). One dtype per call, as torch's foreach
    groups.
    """
    if not params:
        return
    work = [p if p.dtype in (torch.float32, torch.float64) else p.float() for p in params]
    g32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    if weight_decay != 0:
        torch._foreach_mul_(work, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g32, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1 - beta2)
    step_size = [(lr / (1 - beta1**s)) * -1 for s in steps]
    bc2_sqrt = [(1 - beta2**s) ** 0.5 for s in steps]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, step_size)
    for p, w in zip(params, work, strict=True):
        if p is not w:
            p.copy_(w)
