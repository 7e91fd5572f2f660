"""A loaded optimizer state is untrusted: it is checked against its parameter before any C
kernel can touch it (issue 12 §3), and torch's load hooks see the real state (issue 16)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_fp8.numerics.coat import dequantize_groups
from hf_fp8.optim import AdamWFp8
from hf_fp8.optim._layout import is_quantized_state
from hf_fp8.optim._state_check import OptimizerStateError

ROOT = Path(__file__).resolve().parents[2]

# Each case tampers with a saved state (or the model) the way a user or a bad file can; with
# the old code every one reached the C kernel and wrote out of bounds (SIGSEGV / abort).
# They run in a subprocess: a native crash fails the test instead of killing pytest.
CRASH_SCRIPT = textwrap.dedent(
    """
    import io, json, sys, torch
    from hf_fp8.optim import AdamWFp8, _cpu_kernel

    FMT = sys.argv[2]  # moment_format
    EXP = "exp_avg_exponent" if FMT == "fp8" else "exp_avg_sq_exponent"
    WRONG = torch.uint8 if FMT == "fp8" else torch.int8  # a code dtype of the other format

    def make(rows=256):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(rows, 300) * 0.1)
        return p, AdamWFp8([p], lr=1e-2, implementation=sys.argv[1], moment_format=FMT)

    def saved():
        p, opt = make()
        p.grad = torch.randn_like(p)
        opt.step()
        buf = io.BytesIO(); torch.save(opt.state_dict(), buf); buf.seek(0)
        return torch.load(buf, weights_only=True)

    def tamper(key, fn):
        def case():
            sd = saved(); st = sd["state"][0]; st[key] = fn(st[key]); return sd, 256
        return case

    cases = {
        "grown_embedding": lambda: (saved(), 264),
        "fp16_scales": tamper("exp_avg_scale", lambda t: t.half()),
        "rows_by_1_scales": tamper("exp_avg_sq_scale", lambda t: t[:, :1].contiguous()),
        "short_codes": tamper("exp_avg_fp8", lambda t: t.reshape(-1)[:1000].clone()),
        "wrong_code_dtype": tamper("exp_avg_sq_fp8", lambda t: t.view(WRONG)),
        "nan_scale": tamper("exp_avg_scale", lambda t: t.fill_(float("nan"))),
        "zero_exponent": tamper(EXP, lambda t: t.zero_()),
        "missing_exponent": lambda: (
            {"state": {0: {k: v for k, v in saved()["state"][0].items()
                           if k != "exp_avg_sq_exponent"}},
             "param_groups": saved()["param_groups"]}, 256),
    }
    out = {}
    for name, case in cases.items():
        sd, rows = case()
        p, opt = make(rows)
        try:
            opt.load_state_dict(sd)
            p.grad = torch.randn_like(p)
            opt.step()
            out[name] = "accepted"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    # State modified after loading: the launch check refuses it before the C call.
    p, opt = make()
    p.grad = torch.randn_like(p); opt.step()
    opt.state[p]["exp_avg_scale"] = opt.state[p]["exp_avg_scale"][:10].clone()
    try:
        p.grad = torch.randn_like(p); opt.step(); out["mutated_after_load"] = "accepted"
    except Exception as exc:
        out["mutated_after_load"] = f"{type(exc).__name__}: {exc}"

    # The C side itself: a task whose sizes do not match is refused without touching memory.
    if sys.argv[1] == "cpu_kernel":
        batch = _cpu_kernel.Batch()
        p, opt = make()
        p.grad = torch.randn_like(p); opt.step()
        st = opt.state[p]
        from hf_fp8.optim import _step
        hp = _step.hyperparams(opt.param_groups[0], 2.0, p.device)
        states = tuple(st.get(k) for k in ("exp_avg_fp8", "exp_avg_scale", "exp_avg_exponent",
                                           "exp_avg_sq_fp8", "exp_avg_sq_scale",
                                           "exp_avg_sq_exponent"))
        batch.add(p.data, p.grad, states, hp, 300, 128, True, log=FMT == "log")
        task = batch.tasks[0]
        task[_cpu_kernel.TASK_FIELDS.index("m_s_n")] = 3  # a lying size
        try:
            _cpu_kernel.launch([task]); out["c_bad_size"] = "accepted"
        except Exception as exc:
            out["c_bad_size"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("fmt", ["log", "fp8"])
@pytest.mark.parametrize("implementation", ["cpu_kernel", "reference"])
def test_tampered_states_are_refused_without_native_crash(implementation, fmt):
    if implementation == "cpu_kernel":
        from hf_fp8.utils import native

        if native.compiler() is None:
            pytest.skip("no C compiler")
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, implementation, fmt],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**__import__("os").environ, "HF_FP8_COMPILE": "0"},
    )
    assert proc.returncode == 0, f"native crash or error (rc {proc.returncode}):\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, result in out.items():
        if name == "mutated_after_load":
            assert result.startswith(("ValueError", "RuntimeError", "KernelStepError")), (
                name,
                result,
            )
        elif name == "c_bad_size":  # KernelStepError is a RuntimeError (touched nothing)
            assert result.startswith("KernelStepError") and "sizes" in result, result
        else:
            assert result.startswith("OptimizerStateError"), (name, result)
            assert "parameter 0" in result and "state_dict['state']" in result, result
    assert "has shape (256, 384), the parameter needs (264, 384)" in out["grown_embedding"]
    assert "float16" in out["fp16_scales"]


def _roundtrip(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _params():
    g = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(64, 256, generator=g) * 0.1),
        torch.nn.Parameter(torch.randn(256, generator=g) * 0.1),
    ]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10 ** torch.empty(p.shape).uniform_(
            -3, 0, generator=g
        )


@pytest.mark.parametrize("fmt", ["log", "fp8"])
def test_torch_adamw_state_becomes_fp8_and_resumes_like_adamw(fmt):
    hp = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    ref = _params()
    adamw = torch.optim.AdamW(ref, **hp)
    for step in range(3):
        _grads(ref, step)
        adamw.step()
    saved = _roundtrip(adamw.state_dict())
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = AdamWFp8(ours, moment_format=fmt, **hp)
    with pytest.warns(RuntimeWarning, match="converted the fp32 moments of 1 parameter"):
        opt.load_state_dict(saved)
    big, small = opt.state[ours[0]], opt.state[ours[1]]
    assert is_quantized_state(big) and not is_quantized_state(small)
    assert float(big["step"]) == 3.0
    m, v = opt.moments(ours[0])
    if fmt == "fp8":  # the paper's decoding, independent of moments()
        m_paper = dequantize_groups(
            big["exp_avg_fp8"].view(-1, 128),
            big["exp_avg_scale"].view(-1),
            big["exp_avg_exponent"].view(-1),
        ).view(64, 256)
        assert torch.equal(m, m_paper)
    m_ref, v_ref = adamw.state[ref[0]]["exp_avg"], adamw.state[ref[0]]["exp_avg_sq"]
    assert (m - m_ref).norm() / m_ref.norm() < 0.05
    assert (v - v_ref).norm() / v_ref.norm() < 0.1
    assert torch.equal(small["exp_avg_sq"], adamw.state[ref[1]]["exp_avg_sq"])
    before = [p.detach().clone() for p in ref]
    _grads(ref, 3)
    _grads(ours, 3)
    adamw.step()
    opt.step()
    upd_ref = ref[0].detach() - before[0]
    upd = ours[0].detach() - before[0]
    assert (upd - upd_ref).norm() / upd_ref.norm() < 0.05
    assert torch.equal(ours[1], ref[1])  # fp32-state tensors follow AdamW exactly


def test_amsgrad_state_is_refused():
    ps = _params()
    adamw = torch.optim.AdamW(ps, amsgrad=True)
    _grads(ps, 0)
    adamw.step()
    with pytest.raises(ValueError, match="amsgrad"):
        AdamWFp8(_params()).load_state_dict(_roundtrip(adamw.state_dict()))


@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (0,)])
def test_zero_size_param_with_min_quantize_numel_zero(shape):
    p = torch.nn.Parameter(torch.zeros(shape))
    q = torch.nn.Parameter(torch.ones(8, 256))
    opt = AdamWFp8([p, q], min_quantize_numel=0)
    for _ in range(2):
        p.grad, q.grad = torch.zeros(shape), torch.ones(8, 256)
        opt.step()
    assert not is_quantized_state(opt.state[p]) and is_quantized_state(opt.state[q])
    other = AdamWFp8([torch.nn.Parameter(torch.zeros(shape)), q], min_quantize_numel=0)
    other.load_state_dict(_roundtrip(opt.state_dict()))


def test_load_hooks_see_the_real_state():
    ps = _params()
    opt = AdamWFp8(ps)
    _grads(ps, 0)
    opt.step()
    saved = _roundtrip(opt.state_dict())
    other = AdamWFp8(_params())
    seen = {}

    def pre(optimizer, state_dict):
        seen["pre"] = len(state_dict["state"])

    def post(optimizer):
        seen["post"] = sorted(len(s) for s in optimizer.state.values())

    other.register_load_state_dict_pre_hook(pre)
    other.register_load_state_dict_post_hook(post)
    other.load_state_dict(saved)
    assert seen == {"pre": 2, "post": [3, 7]}  # fp32 (step + 2) and fp8 COAT (step + 6)


def test_refused_load_changes_nothing():
    ps = _params()
    opt = AdamWFp8(ps)
    _grads(ps, 0)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    groups_before = [dict(g) for g in opt.param_groups]
    bad = _roundtrip(opt.state_dict())
    bad["param_groups"][0]["lr"] = 0.5
    bad["state"][1]["exp_avg"] = torch.zeros(3)
    with pytest.raises(OptimizerStateError, match=r"parameter 1, state\['exp_avg'\]"):
        opt.load_state_dict(bad)
    assert all(torch.equal(before[k], opt.state[ps[0]][k]) for k in before)
    assert opt.param_groups[0]["lr"] == groups_before[0]["lr"]
