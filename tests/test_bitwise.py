"""The shared bit-equality helper catches what torch.equal lets through."""

import pytest
import torch

from tests.bitwise import assert_bit_equal, assert_states_bit_equal


def test_signed_zero_dtype_and_shape_differences_are_caught() -> None:
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # why bytes are compared
    with pytest.raises(AssertionError, match="bytes differ"):
        assert_bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    with pytest.raises(AssertionError, match="dtype"):
        assert_bit_equal(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="shape"):
        assert_bit_equal(torch.zeros(2, 1), torch.zeros(2))


def test_fp8_nan_and_state_dicts() -> None:
    nan = torch.full((3,), float("nan")).to(torch.float8_e4m3fn)
    assert_bit_equal(nan, nan.clone(), "nan")  # equal payloads are equal bits
    a = {"w": torch.ones(2, 2).to(torch.float8_e5m2), "s": torch.ones(1)}
    assert_states_bit_equal(a, {k: v.clone() for k, v in a.items()})
    with pytest.raises(AssertionError, match=r"keys differ.*'x'"):
        assert_states_bit_equal(a, {**a, "x": torch.ones(1)})
    with pytest.raises(AssertionError, match=r"^s: bytes differ"):
        assert_states_bit_equal(a, {**a, "s": torch.full((1,), 2.0)})
