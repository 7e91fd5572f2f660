"""fp8 format names, dtypes and limits."""

import pytest
import torch

from hf_fp8.numerics import FP8_DTYPES, fp8_dtype, fp8_format_of, fp8_max, is_fp8, min_scale
from hf_fp8.recipe import Fp8Format


def test_format_names_map_to_torch_dtypes() -> None:
    assert fp8_dtype("e4m3") is torch.float8_e4m3fn
    assert fp8_dtype("e5m2") is torch.float8_e5m2
    # every format word of the recipe has a dtype, and the map inverts
    assert set(FP8_DTYPES) == set(Fp8Format)
    assert all(fp8_format_of(fp8_dtype(f)) is f for f in Fp8Format)
    with pytest.raises(ValueError, match="not an fp8 dtype"):
        fp8_format_of(torch.bfloat16)


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


def test_the_smallest_scale_is_a_normal_float32_with_a_finite_inverse() -> None:
    tiny = torch.tensor(min_scale(), dtype=torch.float32)
    assert tiny.item() > 0 and tiny.item() == torch.finfo(torch.float32).tiny
    assert bool(torch.isfinite(1 / tiny)) and (tiny / 2).item() < tiny.item()  # not the floor
