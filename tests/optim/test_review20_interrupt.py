"""Ctrl-C during ``AdamWFp8.step`` applies the whole step or none of it (reviewer R20 F5).

A SIGINT that arrived while the C kernel ran was raised when the ctypes call returned: the
kernel's weights were updated, the fp32-state parameters (biases) had their step count advanced
and no update; one that arrived while the step was planned advanced every count with no update
(the rollback caught ``Exception`` only). References: a twin optimizer that stepped without
interruption (same code path, never interrupted) and ``torch.optim.AdamW`` for the fp32 states.
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch

from hf_fp8.optim import AdamWFp8, _cpu_kernel
from hf_fp8.optim import adamw_fp8 as adamw_module


def _make():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 512))  # FP8 states, C kernel
    b = torch.nn.Parameter(torch.randn(256))  # fp32 states
    h = torch.nn.Parameter(torch.randn(128, 256, dtype=torch.float16))  # FP8 states, eager path
    n = torch.nn.Parameter(torch.randn(64))  # fp32 states, second group
    groups = [{"params": [w, b, h]}, {"params": [n], "weight_decay": 0.0}]
    return [w, b, h, n], AdamWFp8(groups, lr=1e-2, weight_decay=0.1)


def _grads(params, i: int) -> None:
    gen = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _snapshot(opt, params) -> list:
    return [
        (
            p.detach().clone(),
            {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state.get(p, {}).items()},
        )
        for p in params
    ]


def _assert_same(a: list, b: list) -> None:
    for i, ((pa, sa), (pb, sb)) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(pa, pb), f"parameter {i} differs"
        assert sa.keys() == sb.keys(), f"parameter {i}: state keys {sa.keys()} != {sb.keys()}"
        for key, value in sa.items():
            assert torch.equal(value, sb[key]), f"parameter {i}: state {key!r} differs"


def _twin(steps: int) -> list:
    """The same run, never interrupted."""
    params, opt = _make()
    for i in range(steps):
        _grads(params, i)
        opt.step()
    return _snapshot(opt, params)


def _torch_adamw(steps: int) -> list[torch.Tensor]:
    """The fp32-state parameters (``b``, ``n``) stepped by ``torch.optim.AdamW``."""
    params, _ = _make()
    b, n = params[1], params[3]
    opt = torch.optim.AdamW(
        [{"params": [b]}, {"params": [n], "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
        foreach=False,
    )
    for i in range(steps):
        _grads(params, i)
        opt.step()
    return [b.detach(), n.detach()]


def _interrupted_run(monkeypatch, patch_at_step: int, install) -> tuple[list, AdamWFp8, bool]:
    """Three steps; ``install(monkeypatch)`` patches the step numbered ``patch_at_step``;
    returns the parameters, the optimizer and whether that step raised KeyboardInterrupt."""
    params, opt = _make()
    interrupted = False
    for i in range(3):
        _grads(params, i)
        if i == patch_at_step:
            with monkeypatch.context() as mp:
                install(mp)
                try:
                    opt.step()
                except KeyboardInterrupt:
                    interrupted = True
        else:
            opt.step()
    return params, opt, interrupted


def _signal_in_launch(after: bool):
    real = _cpu_kernel.launch

    def launch(tasks):
        if not after:
            signal.raise_signal(signal.SIGINT)
        real(tasks)
        if after:  # the signal arrives while the C call runs: raised when it returns
            signal.raise_signal(signal.SIGINT)

    return lambda mp: mp.setattr(_cpu_kernel, "launch", launch)


def _while_planning(interrupt):
    def install(mp):
        real = adamw_module._stream_keys
        calls = []

        def keys(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # planning the fp16 weight: the first weight's count advanced
                interrupt()
            return real(*args, **kwargs)

        mp.setattr(adamw_module, "_stream_keys", keys)

    return install


def _signal_while_planning():
    return _while_planning(lambda: signal.raise_signal(signal.SIGINT))


@pytest.fixture(autouse=True)
def _default_sigint():
    """The tests raise real SIGINTs: Python's default handler (KeyboardInterrupt) must be set."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize(
    "install",
    [_signal_in_launch(after=True), _signal_in_launch(after=False), _signal_while_planning()],
    ids=["sigint-as-kernel-returns", "sigint-before-kernel", "sigint-while-planning"],
)
@pytest.mark.parametrize("at_step", [0, 1])
def test_ctrl_c_during_a_step_completes_it_then_raises(monkeypatch, install, at_step) -> None:
    """The step is applied whole (every parameter and state equals the uninterrupted twin's),
    then KeyboardInterrupt is raised; the handler is back in place."""
    params, opt, interrupted = _interrupted_run(monkeypatch, at_step, install)
    assert interrupted, "the Ctrl-C was lost"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _assert_same(_snapshot(opt, params), _twin(3))
    b_ref, n_ref = _torch_adamw(3)
    torch.testing.assert_close(params[1].detach(), b_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(params[3].detach(), n_ref, rtol=1e-6, atol=1e-7)
    for p in params:
        assert float(opt.state[p]["step"]) == 3.0


def _raise_in_launch(after: bool):
    real = _cpu_kernel.launch

    def launch(tasks):
        if after:
            real(tasks)
        raise KeyboardInterrupt  # not a signal: raised by code, like an exception

    return lambda mp: mp.setattr(_cpu_kernel, "launch", launch)


def _raise_while_planning():
    def interrupt():
        raise KeyboardInterrupt  # not a signal

    return _while_planning(interrupt)


@pytest.mark.parametrize(
    "install",
    [_raise_in_launch(after=False), _raise_while_planning()],
    ids=["raised-before-kernel", "raised-while-planning"],
)
@pytest.mark.parametrize("at_step", [0, 1])
def test_keyboard_interrupt_before_any_update_changes_nothing(monkeypatch, install, at_step):
    """A KeyboardInterrupt raised before any weight changed rolls the step counts back (and
    drops the states this step created): retaking the step gives the uninterrupted run."""
    params, opt = _make()
    for i in range(at_step):
        _grads(params, i)
        opt.step()
    _grads(params, at_step)
    before = _snapshot(opt, params)
    with monkeypatch.context() as mp:
        install(mp)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
    _assert_same(_snapshot(opt, params), before)
    opt.step()  # the retry
    for i in range(at_step + 1, 3):
        _grads(params, i)
        opt.step()
    _assert_same(_snapshot(opt, params), _twin(3))


def test_a_custom_sigint_handler_runs_once_after_the_step(monkeypatch) -> None:
    """A user's SIGINT handler (a graceful-stop flag) runs after the step, not inside it."""
    seen: list[bool] = []
    params, opt = _make()

    def handler(signum, frame):
        # the step is complete when the handler runs: every parameter has stepped
        seen.append(all(float(opt.state[p]["step"]) == 1.0 for p in params))

    signal.signal(signal.SIGINT, handler)
    _grads(params, 0)
    with monkeypatch.context() as mp:
        _signal_in_launch(after=True)(mp)
        opt.step()
    assert seen == [True]
    assert signal.getsignal(signal.SIGINT) is handler
    for i in (1, 2):
        _grads(params, i)
        opt.step()
    _assert_same(_snapshot(opt, params), _twin(3))


def test_a_step_in_another_thread_is_unaffected() -> None:
    """Only the main thread can set handlers: a step in another thread runs as before."""
    params, opt = _make()
    errors: list[BaseException] = []

    def work():
        try:
            for i in range(3):
                _grads(params, i)
                opt.step()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _assert_same(_snapshot(opt, params), _twin(3))


def test_a_second_ctrl_c_interrupts_at_once(monkeypatch) -> None:
    """While a step holds one Ctrl-C, a second one raises at once (a long first
    ``torch.compile`` stays interruptible); the default handler is back afterwards."""
    params, opt = _make()
    _grads(params, 0)
    reached: list[str] = []
    real = _cpu_kernel.launch

    def launch(tasks):
        signal.raise_signal(signal.SIGINT)  # held
        signal.raise_signal(signal.SIGINT)  # runs the handler now
        reached.append("after")
        real(tasks)

    monkeypatch.setattr(_cpu_kernel, "launch", launch)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert reached == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
