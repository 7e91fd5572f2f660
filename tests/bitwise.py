"""The one bit-equality helper of the test suite: same names, dtypes, shapes and bytes.

``torch.equal`` is not bit equality: it says ``0.0 == -0.0`` and ``NaN != NaN``, and it cannot
compare fp8 tensors on every device. These compare the raw bytes instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` as integers of the same width (flattened, detached)."""
    return t.detach().contiguous().reshape(-1).view(_INTS[t.dtype.itemsize])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, name: str = "tensor") -> None:
    """Same dtype, shape and bytes (``-0.0`` differs from ``0.0``; equal NaN payloads match)."""
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{name}: bytes differ"


def assert_states_bit_equal(
    a: Mapping[str, torch.Tensor] | torch.nn.Module, b: Mapping[str, torch.Tensor] | torch.nn.Module
) -> None:
    """Two state dicts (or modules' state dicts) with the same keys and bit-equal tensors."""
    sa = a.state_dict() if isinstance(a, torch.nn.Module) else a
    sb = b.state_dict() if isinstance(b, torch.nn.Module) else b
    assert sa.keys() == sb.keys(), f"keys differ: {sorted(set(sa) ^ set(sb))}"
    for key in sa:
        assert_bit_equal(sa[key], sb[key], key)
