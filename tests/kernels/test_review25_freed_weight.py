"""R25 F7 follow-up: a C kernel never reads a weight whose storage was freed.

FSDP2 frees an unsharded parameter by resizing its storage to 0 and keeps its shape; when a
dropped pre-backward hook left such a weight in place, the backward decode read freed memory
(segfault on the old code, two-rank test in test_review25_fsdp2_inplace.py). Now the kernel
entry refuses it with an error naming the fix. Reference: the same call on the intact weight.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel
from hf_fp8.numerics import quantize_weight

PATHS = [p for p in cpu_kernel.supported_paths() if cpu_kernel.library(p) is not None]


@pytest.mark.skipif(not PATHS, reason="no C kernel path builds here")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("freed", ["weight", "scale"])
def test_decode_of_a_freed_weight_is_refused(path, freed) -> None:
    w8, ws = quantize_weight(torch.randn(32, 64), torch.float8_e4m3fn, "row")
    ws = ws.contiguous()
    intact = cpu_kernel.decode(w8, ws, "row", (128, 128), torch.float32, path=path)
    assert torch.allclose(intact, w8.float() * ws.reshape(-1, 1))
    target = w8 if freed == "weight" else ws
    target.untyped_storage().resize_(0)  # what FSDP2's reshard does
    with pytest.raises(ValueError, match="storage smaller than its shape"):
        cpu_kernel.decode(w8, ws, "row", (128, 128), torch.float32, path=path)
