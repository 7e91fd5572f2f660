"""AdamWFp8 against torch.optim.AdamW and a float64 AdamW + COAT reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.optim._layout import is_quantized_state, resolved_format, state_bytes
from tests.optim.reference import (
    FMAX,
    adamw_reference,
    coat_reference,
    dequant_reference,
    log_m_dequant_reference,
    log_m_exponent,
    log_m_quant_reference,
    log_v_dequant_reference,
    log_v_quant_reference,
)

HP = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}


def grads_for(params: list[torch.Tensor], step: int) -> None:
    """Gradients with magnitudes spread over four decades, fixed by ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        mag = 10 ** torch.empty(p.shape).uniform_(-4, 0, generator=g)
        p.grad = (torch.randn(p.shape, generator=g) * mag).to(p.dtype)


def make_params(shapes, dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in shapes]


def state_groups(state: dict, key: str, rows: int) -> tuple:
    q, scale = state[f"{key}_fp8"], state[f"{key}_scale"]
    gc = scale.shape[1]
    return q.view(rows, gc, -1), scale, state.get(f"{key}_exponent")


def test_small_tensors_match_torch_adamw_exactly():
    shapes = [(10,), (30, 20), (5, 5, 4)]  # all below min_quantize_numel: fp32 states
    ours, ref = make_params(shapes), make_params(shapes)

    def groups(ps: list[torch.Tensor]) -> list[dict]:
        return [
            {"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.9)},
        ]

    rest = {k: v for k, v in HP.items() if k != "lr"}
    opt = AdamWFp8(groups(ours), **rest)
    torch_opt = torch.optim.AdamW(groups(ref), foreach=True, **rest)
    for step in range(6):
        grads_for(ours, step)
        grads_for(ref, step)
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
        assert not is_quantized_state(opt.state[a])
        assert torch.equal(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"])


def step_against_float64(p, opt, step: int, m, v) -> tuple:
    """One ``opt.step()`` of ``p`` from the dequantized moments ``m``, ``v``: the parameter
    equals AdamW in float64 within fp32 arithmetic and the polynomial log2/exp2 (a few 1e-6,
    amplified where m nearly cancels), far below what a 0.1% slip in β1 or β2 would cause.
    Returns the reference ``(m, v)`` after the step."""
    p_before = p.detach().double().clone()
    grads_for([p], step)
    opt.step()
    p_ref, m_ref, v_ref = adamw_reference(p_before, p.grad, m, v, step, **HP)
    update = p_ref - p_before
    err = (p.detach().double() - p_ref).abs()
    bound = 1e-4 * update.abs() + 2e-6 * update.abs().max() + 1e-6 * p_ref.abs()
    assert (err <= bound).all()
    return m_ref, v_ref


@pytest.mark.parametrize("implementation", ["cpu_kernel", "reference"])
@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("shape", [(64, 256), (48, 200)])  # whole groups / padded last group
def test_quantized_step_matches_float64_reference(expand, shape, implementation):
    """Each step, from the optimizer's own stored state, equals AdamW done in float64 on the
    dequantized moments; the new codes equal the paper's COAT quantization of the new moments."""
    (p,) = make_params([shape])
    opt = AdamWFp8(
        [p],
        dynamic_range_expansion=expand,
        moment_format="fp8",
        implementation=implementation,
        stochastic_rounding=False,  # the paper's round-to-nearest codes are compared below
        **HP,
    )
    rows, cols = shape
    for step in range(1, 5):
        state = opt.state[p]
        if state:
            m = dequant_reference(*state_groups(state, "exp_avg", rows)).view(rows, -1)[:, :cols]
            v = dequant_reference(*state_groups(state, "exp_avg_sq", rows)).view(rows, -1)[:, :cols]
        else:
            m = v = torch.zeros(shape, dtype=torch.float64)
        m_ref, v_ref = step_against_float64(p, opt, step, m, v)
        state = opt.state[p]
        assert float(state["step"]) == step
        for key, ref in (("exp_avg", m_ref), ("exp_avg_sq", v_ref)):
            q, _, k = state_groups(state, key, rows)
            padded = torch.nn.functional.pad(ref, (0, q.shape[1] * q.shape[2] - cols))
            groups = padded.view(-1, q.shape[2]).numpy()
            if expand:
                values, ref_k = coat_reference(groups, FMAX[q.dtype])
                assert (k.flatten().numpy() == ref_k).mean() > 0.95
            else:
                amax = abs(groups).max(axis=1, keepdims=True)
                values = groups / (amax / FMAX[q.dtype]).clip(min=1e-300)
                if key == "exp_avg_sq":  # a non-zero v never takes the zero code (R8)
                    values = np.where(groups >= 2.0**-126, np.maximum(values, 2.0**-9), values)
            ref_q = torch.from_numpy(values).float().clamp(-448, 448).to(q.dtype).view(torch.uint8)
            agree = (q.reshape(-1, q.shape[2]).view(torch.uint8) == ref_q).float().mean()
            assert agree > 0.97


def log_moments_reference(state: dict, rows: int, cols: int) -> tuple:
    """float64 ``(m̂, v̂)`` ``[rows, cols]`` of a ``moment_format="log"`` state (tests' own
    decoding of the documented format) and the exponents ``e`` of m's groups."""
    vs, vk, ms = state["exp_avg_sq_scale"], state["exp_avg_sq_exponent"], state["exp_avg_scale"]
    gc = vs.shape[1]
    vq = state["exp_avg_sq_fp8"].view(rows, gc, -1)
    v = log_v_dequant_reference(vq, vs, vk)
    e = log_m_exponent(vq, vs, vk)
    m = log_m_dequant_reference(state["exp_avg_fp8"].view(rows, gc, -1), ms, e)
    return m.view(rows, -1)[:, :cols], v.view(rows, -1)[:, :cols], e.reshape(-1, e.shape[-1])


@pytest.mark.parametrize("implementation", ["cpu_kernel", "reference"])
@pytest.mark.parametrize("shape", [(64, 256), (48, 200)])  # whole groups / padded last group
def test_log_step_matches_float64_reference(shape, implementation):
    """moment_format="log": each step, from the stored codes decoded by the tests' own float64
    reference, equals AdamW in float64; the new codes round the reference's exact code values
    (v first; m relative to the new v̂)."""
    (p,) = make_params([shape])
    opt = AdamWFp8(
        [p], implementation=implementation, stochastic_rounding=False, moment_format="auto", **HP
    )
    assert resolved_format(opt.param_groups[0]) == "log"  # "auto" with e4m3 and expansion
    rows, cols = shape
    for step in range(1, 6):
        state = opt.state[p]
        if state:
            m, v, _ = log_moments_reference(state, rows, cols)
        else:
            m = v = torch.zeros(shape, dtype=torch.float64)
        m_ref, v_ref = step_against_float64(p, opt, step, m, v)
        state = opt.state[p]
        assert state["exp_avg_fp8"].dtype == torch.int8
        assert state["exp_avg_sq_fp8"].dtype == torch.uint8
        assert "exp_avg_exponent" not in state
        gs = state["exp_avg_fp8"].shape[1] // state["exp_avg_scale"].shape[1]

        padded_cols = state["exp_avg_fp8"].shape[1]

        def groups(x: torch.Tensor, gs: int = gs, width: int = padded_cols) -> np.ndarray:
            return torch.nn.functional.pad(x, (0, width - cols)).reshape(-1, gs).numpy()

        t_v, k = log_v_quant_reference(groups(v_ref))
        assert (state["exp_avg_sq_exponent"].flatten().numpy() == k).mean() > 0.95
        codes_v = state["exp_avg_sq_fp8"].reshape(-1, gs).numpy().astype(np.float64)
        assert (np.abs(codes_v - t_v) <= 0.5 + 1e-3).mean() > 0.99
        _, _, e_new = log_moments_reference(state, rows, cols)
        t_m = log_m_quant_reference(groups(m_ref), e_new)
        codes_m = state["exp_avg_fp8"].reshape(-1, gs).numpy().astype(np.float64)
        assert (np.abs(codes_m - t_m) <= 0.5 + 1e-3).mean() > 0.99


def test_trajectory_close_to_torch_adamw_and_coat_closer_than_plain():
    shapes = [(128, 512), (64, 128)]
    ref = make_params(shapes)
    torch_opt = torch.optim.AdamW(ref, foreach=True, **HP)
    runs = {}
    for expand in (False, True):
        ours = make_params(shapes)
        opt = AdamWFp8(ours, dynamic_range_expansion=expand, **HP)
        for step in range(30):
            grads_for(ours, step)
            opt.step()
        runs[expand] = ours
    for step in range(30):
        grads_for(ref, step)
        torch_opt.step()
    start = make_params(shapes)
    errors = {}
    with torch.no_grad():
        for expand, ours in runs.items():
            num = sum((a - b).pow(2).sum() for a, b in zip(ours, ref, strict=True))
            den = sum((b - s).pow(2).sum() for b, s in zip(ref, start, strict=True))
            errors[expand] = float((num / den).sqrt())
    assert errors[True] < 0.05
    assert errors[True] < errors[False]


def test_bf16_params_follow_fp32_run():
    shapes = [(64, 256)]
    p32, p16 = make_params(shapes), make_params(shapes, torch.bfloat16)
    o32, o16 = AdamWFp8(p32, **HP), AdamWFp8(p16, **HP)
    for step in range(10):
        grads_for(p32, step)
        grads_for(p16, step)
        o32.step()
        o16.step()
    assert p16[0].dtype == torch.bfloat16
    assert o16.state[p16[0]]["exp_avg_scale"].dtype == torch.float32
    start = make_params(shapes)[0]
    moved = (p32[0] - start).norm()
    assert (p16[0].float() - p32[0]).norm() < 0.05 * moved


def test_param_groups_behave_like_separate_optimizers():
    shapes = [(64, 256), (32, 256), (64,)]
    ps = make_params(shapes)
    opt = AdamWFp8(
        [
            {"params": ps[:1], "lr": 1e-3, "group_size": 64},
            {"params": ps[1:], "lr": 5e-3, "dynamic_range_expansion": False, "weight_decay": 0.0},
        ],
        weight_decay=0.1,
        stochastic_rounding=False,  # random streams follow the parameter's global index
    )
    fresh = make_params(shapes)  # same values as ps
    a, b = fresh[:1], fresh[1:]
    rtn = {"stochastic_rounding": False}
    opt_a = AdamWFp8(a, lr=1e-3, group_size=64, weight_decay=0.1, **rtn)
    opt_b = AdamWFp8(b, lr=5e-3, dynamic_range_expansion=False, weight_decay=0.0, **rtn)
    for step in range(5):
        for params in (ps, a + b):
            grads_for(params, step)
        opt.step()
        opt_a.step()
        opt_b.step()
    for x, y in zip(ps, a + b, strict=True):
        assert torch.equal(x, y)
    assert opt.state[ps[0]]["exp_avg_scale"].shape == (64, 4)  # 256 / group_size 64
    assert "exp_avg_exponent" not in opt.state[ps[1]]


def test_tensor_lr_equals_float_lr_and_closure_returns_loss():
    shapes = [(64, 256)]
    a, b = make_params(shapes), make_params(shapes)
    hp = {k: v for k, v in HP.items() if k != "lr"}
    opt_a = AdamWFp8(a, lr=1e-2, **hp)
    opt_b = AdamWFp8(b, lr=torch.tensor(1e-2, dtype=torch.float64), **hp)
    for step in range(4):
        grads_for(a, step)
        opt_a.step()

        def closure(step=step):
            grads_for(b, step)
            return torch.tensor(float(step))

        assert float(opt_b.step(closure)) == step
    assert torch.equal(a[0], b[0])


def test_state_is_compact_and_small_tensors_stay_fp32():
    ps = make_params([(256, 1024), (100, 100), (4096,), (10, 10)])
    opt = AdamWFp8(ps, **HP)  # the default: fp8 codes with COAT expansion
    grads_for(ps, 0)
    opt.step()
    big, odd, vec, tiny = (opt.state[p] for p in ps)
    assert state_bytes(big) / ps[0].numel() <= 2.13
    assert state_bytes(big) == 2 * 256 * 1024 + 4 * 4 * 256 * 8  # 2 codes + 4 fp32 per group
    log = AdamWFp8(make_params([(256, 1024)]), moment_format="log")
    p = log.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    log.step()
    assert state_bytes(log.state[p]) == 2 * 256 * 1024 + 3 * 4 * 256 * 8  # 3 fp32 per group
    assert state_bytes(log.state[p]) / p.numel() <= 2.1
    assert is_quantized_state(odd) and odd["exp_avg_fp8"].shape == (100, 128)  # padded row
    assert not is_quantized_state(vec) and not is_quantized_state(tiny)
    assert vec["exp_avg"].dtype == torch.float32
    plain = AdamWFp8(make_params([(256, 1024)]), dynamic_range_expansion=False)
    p = plain.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    plain.step()
    assert state_bytes(plain.state[p]) / p.numel() <= 2.07


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"eps": -1e-8}, "eps"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": True}, "group_size"),
        ({"fp8_format": "e3m4"}, "e4m3"),
        ({"dynamic_range_expansion": 1}, "bool"),
        ({"min_quantize_numel": -1}, "min_quantize_numel"),
        ({"amsgrad": True}, "amsgrad"),
        ({"implementation": "triton"}, "implementation"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "one element"),
        ({"moment_format": "int4"}, "moment_format"),
        ({"moment_format": "log", "dynamic_range_expansion": False}, "moment_format='fp8'"),
        ({"moment_format": "log", "fp8_format": "e5m2"}, "fp8_format"),
        ({"moment_format": "log", "sqrt_second_moment": True}, "sqrt_second_moment"),
    ],
)
def test_invalid_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamWFp8(make_params([(4, 4)]), **kwargs)


def test_invalid_param_group_is_not_added():
    opt = AdamWFp8(make_params([(4, 4)]))
    with pytest.raises(ValueError, match="group_size"):
        opt.add_param_group({"params": make_params([(4, 4)], seed=1), "group_size": -3})
    assert len(opt.param_groups) == 1


def test_complex_integer_and_sparse_are_refused():
    with pytest.raises(ValueError, match="complex"):
        AdamWFp8([torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="floating-point"):
        AdamWFp8([torch.zeros(4, dtype=torch.int32)])
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamWFp8(emb.parameters()).step()


def test_params_without_grad_are_skipped():
    ps = make_params([(64, 256), (64, 256)])
    opt = AdamWFp8(ps, **HP)
    before = ps[1].detach().clone()
    grads_for(ps[:1], 0)
    opt.step()
    assert torch.equal(ps[1], before) and not opt.state[ps[1]]


@pytest.mark.parametrize("implementation", ["cpu_kernel", "reference"])
def test_non_contiguous_param_matches_contiguous_copy(implementation):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(256, 64, generator=g) * 0.1).t())  # [64, 256], strided
    q = torch.nn.Parameter(p.detach().contiguous().clone())
    opts = [AdamWFp8([x], implementation=implementation, **HP) for x in (p, q)]
    for step in range(3):
        grads_for([q], step)
        p.grad = q.grad.clone()
        for opt in opts:
            opt.step()
    assert not p.is_contiguous() and torch.equal(p, q)
