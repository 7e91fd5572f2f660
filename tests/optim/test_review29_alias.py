"""R29 findings 2 and 4: parameters that share memory. ``torch.optim.AdamW`` steps them one
after the other (both updates land in the shared memory); AdamWFp8 kept only one update (a
stale contiguous copy of a transposed alias was written back) or raced two kernel threads on
the same memory, and an expanded (stride-0) parameter made the step fail after the C kernel
had updated the other parameters, whose fresh states were then deleted ("rolled back"). Such
parameters are now refused before anything changes, with the names of both parameters."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8

IMPLEMENTATIONS = ("auto", "reference")


def _snapshot(opt, params):
    return [
        (p.detach().clone(), {k: v.clone() for k, v in opt.state.get(p, {}).items()})
        for p in params
    ]


def _unchanged(opt, params, before) -> bool:
    for p, (w, st) in zip(params, before, strict=True):
        now = opt.state.get(p, {})
        if not torch.equal(p.detach(), w) or now.keys() != st.keys():
            return False
        if not all(torch.equal(now[k], v) for k, v in st.items()):
            return False
    return True


def _torch_step(params, grads):
    """What torch.optim.AdamW does with the aliases: both updates in the shared memory."""
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["transposed", "same", "row-slice"])
def test_parameters_sharing_memory_are_refused(implementation, layout):
    torch.manual_seed(0)
    base = torch.randn(32, 256)
    make_b = {
        "transposed": lambda a: torch.nn.Parameter(a.detach().t()),
        "same": lambda a: torch.nn.Parameter(a.detach()),
        "row-slice": lambda a: torch.nn.Parameter(a.detach()[8:24]),
    }[layout]
    # torch applies both updates: the shared weight moves by more than either update alone
    a_t = torch.nn.Parameter(base.clone())
    b_t = make_b(a_t)
    ga, gb = torch.randn_like(a_t), torch.randn_like(b_t)
    _torch_step([a_t, b_t], [ga, gb])
    alone = torch.nn.Parameter(base.clone())
    _torch_step([alone], [ga])
    assert not torch.equal(a_t.detach(), alone.detach())

    other = torch.nn.Parameter(torch.randn(32, 256))
    a = torch.nn.Parameter(base.clone())
    b = make_b(a)
    opt = AdamWFp8([other, a, b], lr=1e-2, weight_decay=0.0, implementation=implementation)
    for p, g in ((other, torch.randn_like(other)), (a, ga), (b, gb)):
        p.grad = g.clone()
    before = _snapshot(opt, [other, a, b])
    with pytest.raises(ValueError, match="share memory") as info:
        opt.step()
    assert "parameter 1" in str(info.value) and "parameter 2" in str(info.value)
    assert "nothing was updated" in str(info.value)
    assert _unchanged(opt, [other, a, b], before)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_aliases_without_gradient_and_disjoint_views_step(implementation):
    """Only parameters that step together conflict: an alias without a gradient, and disjoint
    views of one buffer, step as torch.optim.AdamW does them."""
    torch.manual_seed(0)
    buf = torch.randn(64, 256)
    grads = [torch.randn(32, 256), torch.randn(32, 256)]
    flat = buf.clone()
    ours = [torch.nn.Parameter(flat[:32]), torch.nn.Parameter(flat[32:])]
    alias = torch.nn.Parameter(flat[:32])  # no gradient: not stepped
    ref = [torch.nn.Parameter(buf[:32].clone()), torch.nn.Parameter(buf[32:].clone())]
    opt = AdamWFp8([*ours, alias], lr=1e-2, weight_decay=0.0, implementation=implementation)
    twin = AdamWFp8(ref, lr=1e-2, weight_decay=0.0, implementation=implementation)
    for p, q, g in zip(ours, ref, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    twin.step()
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_expanded_parameter_is_refused_before_anything_changes(implementation):
    """p30: a stride-0 (expanded) parameter next to a normal one. The step used to fail after
    the kernel had updated the normal one, whose fresh state was then deleted."""
    torch.manual_seed(0)
    other = torch.nn.Parameter(torch.randn(64, 256))
    expanded = torch.nn.Parameter(torch.randn(1, 256).expand(64, 256))
    opt = AdamWFp8([other, expanded], lr=1e-2, implementation=implementation)
    other.grad, expanded.grad = torch.randn(64, 256), torch.randn(64, 256)
    before = _snapshot(opt, [other, expanded])
    with pytest.raises(ValueError, match="overlap") as info:
        opt.step()
    assert "parameter 1" in str(info.value)
    assert _unchanged(opt, [other, expanded], before)
    # dropping the bad parameter, the retry is the one step torch.optim.AdamW takes
    opt.param_groups[0]["params"] = [other]
    twin_p = torch.nn.Parameter(before[0][0].clone())
    twin = torch.optim.AdamW([twin_p], lr=1e-2)
    twin_p.grad = other.grad.clone()
    opt.step()
    twin.step()
    assert float(opt.state[other]["step"]) == 1.0
    assert torch.allclose(other.detach(), twin_p.detach(), atol=3e-3, rtol=0)


def test_an_error_after_the_kernel_ran_keeps_the_states_of_moved_weights(monkeypatch):
    """Past the kernel launch, weights have moved: an error there (here: the fp32 step of a
    bias) must not roll back the states of the parameters the kernel updated, and says the
    step was partly applied."""
    from hf_fp8.optim import _step

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 256))  # C kernel
    b = torch.nn.Parameter(torch.randn(64))  # fp32 state
    opt = AdamWFp8([w, b], lr=1e-2, implementation="cpu_kernel")
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    w0 = w.detach().clone()

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(_step, "fp32_step", boom)
    with pytest.raises(RuntimeError, match="injected failure") as info:
        opt.step()
    assert not torch.equal(w.detach(), w0)  # the kernel ran
    assert float(opt.state[w]["step"]) == 1.0  # its state stays with the moved weight
    assert bool(opt.state[w]["exp_avg_scale"].gt(0).all())
    assert any("partly applied" in note for note in getattr(info.value, "__notes__", []))
