"""fp8 format names, dtypes and limits."""

import pytest
import torch

from hf_fp8.numerics import AMAX_EPS, FP8_DTYPES, fp8_dtype, fp8_max, is_fp8


def test_format_names_map_to_torch_dtypes() -> None:
    assert fp8_dtype("e4m3") is torch.float8_e4m3fn
    assert fp8_dtype("e5m2") is torch.float8_e5m2
    assert set(FP8_DTYPES) == {"e4m3", "e5m2"}


@pytest.mark.parametrize("bad", ["e4m3fnuz", "fp8", "", None])
def test_unknown_format_names_the_accepted_ones(bad: object) -> None:
    with pytest.raises(ValueError, match=r"e4m3.*e5m2"):
        fp8_dtype(bad)  # type: ignore[arg-type]


def test_fp8_max_is_the_largest_finite_value() -> None:
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e5m2) == 57344.0
    for dtype in FP8_DTYPES.values():
        top = torch.tensor(fp8_max(dtype)).to(dtype)
        assert top.float().item() == fp8_max(dtype)


def test_is_fp8() -> None:
    assert is_fp8(torch.float8_e4m3fn) and is_fp8(torch.float8_e5m2)
    assert not any(is_fp8(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8))


def test_amax_eps_scale_is_finite_and_positive() -> None:
    for dtype in FP8_DTYPES.values():
        scale = AMAX_EPS / fp8_max(dtype)
        assert 0.0 < scale < 1e-12
        assert torch.isfinite(torch.tensor(1.0) / torch.tensor(scale))
