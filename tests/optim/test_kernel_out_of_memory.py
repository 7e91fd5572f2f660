"""The optimizer's C kernel out of memory: the step it refuses leaves every tensor untouched,
so a caller that retries does not apply it twice (with per-thread scratch allocated inside the
workers, a thread that failed had its share stolen by the others: the step was applied, then
reported as failed)."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.utils import native
from tests.optim.kernel_builds import route_kernel_builds

# the kernel's scratch allocator (SCRATCH_ALLOC) for this test: the 4th allocation fails, i.e.
# one of the two threads' scratch on the second step
FAILING_ALLOCATOR = """
#include <stdlib.h>
static int hf_fp8_test_allocations = 0;
static void *hf_fp8_test_alloc(size_t n) {
    return ++hf_fp8_test_allocations == 4 ? NULL : malloc(n);
}
"""


@pytest.fixture
def failing_kernel(tmp_path, monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    header = tmp_path / "failing_allocator.h"
    header.write_text(FAILING_ALLOCATOR)
    built = route_kernel_builds(
        monkeypatch,
        "adamw_fp8_failing_alloc",
        defines={"SCRATCH_ALLOC": "hf_fp8_test_alloc"},
        cflags=("-include", str(header)),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield built
    torch.set_num_threads(threads)


@pytest.mark.parametrize("options", [{}, {"moment_format": "log"}])
def test_a_step_refused_for_memory_touches_nothing(failing_kernel, options) -> None:
    torch.manual_seed(0)
    start, grads = torch.randn(256, 512), [torch.randn(256, 512) for _ in range(2)]
    p = torch.nn.Parameter(start.clone())  # 1024 groups: two threads
    opt = AdamWFp8([p], lr=1e-2, implementation="cpu_kernel", **options)
    p.grad = grads[0].clone()
    opt.step()  # allocations 1 and 2
    assert failing_kernel  # the failing-allocator library did the step
    before = p.detach().clone()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
    p.grad = grads[1].clone()
    with pytest.raises(RuntimeError, match="out of memory"):
        opt.step()  # allocation 4 fails
    assert torch.equal(p.detach(), before)
    for key, value in state.items():
        now = opt.state[p][key]
        assert torch.equal(now, value) if torch.is_tensor(value) else now == value, key
    # the retry takes the step once: as an optimizer that never failed
    opt.step()
    q = torch.nn.Parameter(start.clone())
    reference = AdamWFp8([q], lr=1e-2, implementation="cpu_kernel", **options)
    for g in grads:
        q.grad = g.clone()
        reference.step()
    assert torch.equal(p.detach(), q.detach())
    for key, value in reference.state[q].items():
        now = opt.state[p][key]
        assert torch.equal(now, value) if torch.is_tensor(value) else now == value, key
