"""The fast paths (C kernel, torch.compile) give the reference step's results."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from hf_fp8.optim import AdamWFp8, _cpu_kernel
from hf_fp8.optim._layout import QUANT_KEYS
from hf_fp8.utils import native
from tests.bitwise import assert_bit_equal, assert_states_bit_equal

SHAPES = [(40, 256), (33, 200), (1, 4096), (4, 8, 70), (130,)]
HP = {"lr": 3e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "min_quantize_numel": 1000}

# Skipped only without a C compiler: with one, a kernel that fails to build fails the tests.
needs_kernel = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture
def count_launches(monkeypatch):
    """Number of tasks the C kernel ran: proves the kernel, not a fallback, did the steps."""
    ran = []
    real = _cpu_kernel.launch

    def spy(tasks):
        ran.extend(tasks)
        real(tasks)

    monkeypatch.setattr(_cpu_kernel, "launch", spy)
    return ran


def adversarial_grads(params: list[torch.Tensor], step: int, grad_dtype: torch.dtype) -> None:
    """Magnitudes over 33 decades, zero rows and columns, fp32 denormals, huge values, and
    once a gradient whose square overflows fp32."""
    g = torch.Generator().manual_seed(step)
    for p in params:
        mag = 10 ** torch.empty(p.shape).uniform_(-30, 3, generator=g)
        grad = torch.randn(p.shape, generator=g) * mag
        flat = grad.view(-1)
        flat[:: 7 + step] = 0.0
        if p.dim() >= 2 and p.shape[0] > 1:
            grad[0] = 0.0  # an all-zero row: zero groups
        flat[3] = 1e15 if step % 2 else -1e-38  # g² stays finite; 1e-38 is a denormal
        if step == 1 and flat.numel() > 300:
            flat[300] = -3e21  # g² overflows fp32: v = inf, saturated to FLT_MAX when stored
        if p.shape == (1, 4096):
            grad *= 1e-36  # moments near FLT_MIN: the kernel's clamped exp2 path
        if grad_dtype != p.dtype and hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 checks grad.dtype == param.dtype by default
        p.grad = grad.to(grad_dtype)


def run(
    implementation: str, param_dtype, grad_dtype, fp8_format: str, expand: bool, steps=4, **options
):
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(param_dtype)) for s in SHAPES
    ]
    opt = AdamWFp8(
        params,
        fp8_format=fp8_format,
        dynamic_range_expansion=expand,
        implementation=implementation,
        **HP,
        **options,
    )
    for step in range(steps):
        adversarial_grads(params, step, grad_dtype)
        opt.step()
    return params, opt


def assert_bit_identical(run_a, run_b) -> None:
    (pa, oa), (pb, ob) = run_a, run_b
    for a, b in zip(pa, pb, strict=True):
        assert torch.isfinite(a).all()
        assert_bit_equal(a, b, "param")
        assert_states_bit_equal(oa.state[a], ob.state[b])


DTYPES = [torch.float32, torch.bfloat16]


# (fp8_format, dynamic_range_expansion, moment_format): "auto" resolves to "log" only for
# e4m3 with expansion
FORMATS = [
    ("e4m3", True, "log"),
    ("e4m3", True, "fp8"),
    ("e5m2", True, "auto"),
    ("e4m3", False, "auto"),
    ("e5m2", False, "auto"),
]


@needs_kernel
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "fmt"),
    list(itertools.product(DTYPES, DTYPES, FORMATS)),
    ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_cpu_kernel_is_bit_identical_to_reference(param_dtype, grad_dtype, fmt, count_launches):
    fp8_format, expand, moment_format = fmt
    options = {"moment_format": moment_format}
    reference = run("reference", param_dtype, grad_dtype, fp8_format, expand, **options)
    assert not count_launches
    kernel = run("cpu_kernel", param_dtype, grad_dtype, fp8_format, expand, **options)
    codes = kernel[1].state[kernel[0][0]]["exp_avg_fp8"].dtype
    assert (codes == torch.int8) == (moment_format == "log")
    assert_bit_identical(reference, kernel)
    quantized = [p for p in kernel[0] if QUANT_KEYS[0] in kernel[1].state[p]]
    assert len(quantized) == 4  # the 1-D tensor keeps fp32 states
    assert len(count_launches) == 4 * 4  # every quantized parameter, every step, in C


OPTIONS = [
    {"stochastic_rounding": True},
    {"stochastic_rounding": "exp_avg_sq", "moment_format": "fp8"},
    {"stochastic_rounding": "exp_avg_sq", "seed": 3},
    {"stochastic_rounding": "exp_avg_sq", "sqrt_second_moment": True},
    {"sqrt_second_moment": True},
    {"stochastic_rounding": True, "sqrt_second_moment": True, "seed": 7},
]


@needs_kernel
@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "fp8_format", "expand"),
    [
        (torch.float32, torch.float32, "e4m3", True),
        (torch.bfloat16, torch.float32, "e5m2", True),
        (torch.float32, torch.bfloat16, "e4m3", False),
    ],
)
def test_cpu_kernel_options_are_bit_identical_to_reference(
    param_dtype, grad_dtype, fp8_format, expand, options, count_launches
):
    reference = run("reference", param_dtype, grad_dtype, fp8_format, expand, **options)
    kernel = run("cpu_kernel", param_dtype, grad_dtype, fp8_format, expand, **options)
    assert_bit_identical(reference, kernel)
    assert len(count_launches) == 4 * 4


@needs_kernel
def test_stochastic_rounding_draws_other_bits_per_seed_and_step():
    """Different seeds give different codes; the same seed is reproducible."""
    a = run("cpu_kernel", torch.float32, torch.float32, "e4m3", True, stochastic_rounding=True)
    b = run("cpu_kernel", torch.float32, torch.float32, "e4m3", True, stochastic_rounding=True)
    c = run(
        "cpu_kernel", torch.float32, torch.float32, "e4m3", True, stochastic_rounding=True, seed=1
    )
    assert_bit_identical(a, b)
    codes = [o[1].state[o[0][0]]["exp_avg_sq_fp8"].view(torch.uint8) for o in (a, c)]
    assert not torch.equal(*codes)


@needs_kernel
def test_auto_uses_the_cpu_kernel(count_launches):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kernel unavailable" fallback warning
        run("auto", torch.float32, torch.bfloat16, "e4m3", True, steps=2)
    assert len(count_launches) == 4 * 2


def test_explicit_cpu_kernel_never_falls_back(monkeypatch):
    monkeypatch.setattr(_cpu_kernel, "load", lambda variant=0: None)
    with pytest.raises(RuntimeError, match=r"implementation='cpu_kernel'.*cannot run"):
        run("cpu_kernel", torch.float32, torch.float32, "e4m3", True, steps=1)
    with pytest.raises(RuntimeError, match="cannot run"):  # unsupported dtype: no fallback
        run("cpu_kernel", torch.float16, torch.float16, "e4m3", True, steps=1)


@needs_kernel
def test_cpu_kernel_threads_do_not_change_results(count_launches):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run("cpu_kernel", torch.float32, torch.float32, "e4m3", True)
        torch.set_num_threads(max(2, threads))
        many = run("cpu_kernel", torch.float32, torch.float32, "e4m3", True)
    finally:
        torch.set_num_threads(threads)
    assert_bit_identical(one, many)
    assert len(count_launches) == 2 * 4 * 4


def test_fallbacks_warn_once_and_match_reference(monkeypatch):
    """No C kernel and a failing torch.compile: one warning each, reference results."""
    monkeypatch.setenv("HF_FP8_COMPILE", "1")  # with it off, "auto" never tries to compile
    monkeypatch.setattr(_cpu_kernel, "load", lambda variant=0: None)

    def broken_compile(self):
        def fail(*args):
            raise RuntimeError("no compiler")

        return fail

    monkeypatch.setattr(AdamWFp8, "_compiled_fn", broken_compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = run("auto", torch.float32, torch.float32, "e4m3", True)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert sum("torch.compile failed" in m for m in messages) == 1
    assert sum("CPU kernel unavailable" in m for m in messages) == 1
    assert fallback[1].implementation == "reference"
    assert_bit_identical(run("reference", torch.float32, torch.float32, "e4m3", True), fallback)


@pytest.mark.slow
def test_compiled_step_matches_reference_without_recompiling_for_lr():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    shapes = [(64, 256), (32, 256)]  # two sizes: one graph (dynamic number of groups)

    def make(implementation: str, lr):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]
        opt = AdamWFp8(ps, lr=lr, implementation=implementation)
        return ps, opt

    results = {}
    for tensor_lr in (False, True):
        for implementation in ("reference", "compile"):
            # a fresh tensor per optimizer: LambdaLR updates a tensor lr in place
            ps, opt = make(implementation, torch.tensor(1e-2) if tensor_lr else 1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            graphs = []
            for step in range(4):
                adversarial_grads(ps, step, torch.float32)
                opt.step()
                sched.step()
                graphs.append(counters["stats"]["unique_graphs"])
            results[(implementation, tensor_lr)] = ps
            if implementation == "compile":
                assert graphs[-1] == graphs[0], "the lr schedule caused a recompilation"
    for tensor_lr in (False, True):
        for a, b in zip(
            results[("reference", tensor_lr)], results[("compile", tensor_lr)], strict=True
        ):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@needs_kernel
def test_c_layout_comes_from_the_python_tables(monkeypatch, count_launches):
    """Reordering the task and hyper-parameter tables (the only statement of the layout) still
    gives the reference's bits: the C file reads every field through the generated defines."""
    from hf_fp8.optim import _step

    monkeypatch.setattr(_cpu_kernel, "TASK_FIELDS", tuple(reversed(_cpu_kernel.TASK_FIELDS)))
    monkeypatch.setattr(_step, "HP_FIELDS", tuple(reversed(_step.HP_FIELDS)))
    monkeypatch.setattr(_cpu_kernel, "_LIBS", {})
    reference = run("reference", torch.float32, torch.float32, "e4m3", True, steps=2)
    kernel = run("cpu_kernel", torch.float32, torch.float32, "e4m3", True, steps=2)
    assert_bit_identical(reference, kernel)
    assert len(count_launches) == 4 * 2
    assert _cpu_kernel.kernel_defines(_cpu_kernel.EXPAND)["T_P"] == len(_cpu_kernel.TASK_FIELDS) - 1


def test_c_source_restates_no_layout_constant():
    """Indexing tasks or hyper-parameters by number would bypass the Python tables."""
    import re

    text = _cpu_kernel.SOURCE.read_text()
    assert not re.search(r"\b(t|hp)\[\s*\d", text)
    assert not re.search(r"\b\d+\s*\*\s*k\b", text)  # the old "13 * k" task stride


def test_unavailable_variant_is_recorded_not_retried_each_step(monkeypatch):
    """HF_FP8_DISABLE_CPU_KERNEL=1: one warning, one load attempt per variant, and the
    fallback gives the reference's results."""
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    monkeypatch.setattr(_cpu_kernel, "_LIBS", {})
    monkeypatch.setattr(_cpu_kernel, "_ERRORS", {})
    monkeypatch.setattr(AdamWFp8, "_compiled_fn", lambda self: _step_reference())
    calls = []
    real = native.load_library
    monkeypatch.setattr(native, "load_library", lambda *a, **k: calls.append(1) or real(*a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = run("auto", torch.float32, torch.float32, "e4m3", True, steps=3)
    assert len(calls) == 1
    assert sum("HF_FP8_DISABLE_CPU_KERNEL" in str(w.message) for w in caught) == 1
    assert_bit_identical(
        run("reference", torch.float32, torch.float32, "e4m3", True, steps=3), fallback
    )


def _step_reference():
    from hf_fp8.optim import _step

    return _step.grouped_step
