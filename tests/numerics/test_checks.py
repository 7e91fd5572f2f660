"""hf_fp8.numerics.checks: every bad tensor raises CheckpointTensorError naming it."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.numerics.checks import (
    CheckpointTensorError,
    check_fp8_tensor,
    check_scale_tensor,
    max_scale,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _codes(dtype, values=(0.5, -1.0, 2.0, 0.0)):
    return torch.tensor(values).to(dtype).reshape(2, 2)


def test_good_tensors_pass_unchanged():
    w = _codes(E4M3)
    assert check_fp8_tensor("w", w, dtype=E4M3, shape=(2, 2)) is w
    s = torch.tensor([[0.5], [2.0]])
    assert check_scale_tensor("s", s, shape=(2, 1), max_value=10.0) is s
    # AutoFP8 / vLLM scalar scales stand in for [1]
    check_scale_tensor("s", torch.tensor(0.25), shape=(1,))


def test_error_is_a_value_error():
    assert issubclass(CheckpointTensorError, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_high_precision_in_fp8_slot(dtype):
    with pytest.raises(CheckpointTensorError, match=r"layer\.weight: expected fp8 e4m3.*quantize"):
        check_fp8_tensor("layer.weight", torch.ones(2, 2, dtype=dtype), dtype=E4M3, shape=(2, 2))


def test_other_fp8_format_names_both():
    with pytest.raises(CheckpointTensorError, match=r"w: stored as fp8 e5m2.*fp8_format='e4m3'"):
        check_fp8_tensor("w", _codes(E5M2), dtype=E4M3, shape=(2, 2))
    with pytest.raises(
        CheckpointTensorError,
        match=r"stored as fp8 e4m3.*says fp8_format='e5m2'.*fp8_format='e4m3' if",
    ):
        check_fp8_tensor("w", _codes(E4M3), dtype=E5M2, shape=(2, 2))


def test_fp8_shape():
    with pytest.raises(CheckpointTensorError, match=r"w: expected shape \(4, 1\), found \(2, 2\)"):
        check_fp8_tensor("w", _codes(E4M3), dtype=E4M3, shape=(4, 1))


@pytest.mark.parametrize(
    ("dtype", "bad_bytes"),
    [(E4M3, [0x7F, 0xFF]), (E5M2, [0x7C, 0xFC, 0x7D, 0xFF])],  # NaN; e5m2: ±inf and NaN
)
def test_nonfinite_fp8_codes(dtype, bad_bytes):
    # the bit patterns are written by hand (IEEE-style layouts), not by the code under test
    for byte in bad_bytes:
        raw = torch.tensor([0x38, byte, 0x00, 0x40], dtype=torch.uint8)
        t = raw.view(dtype).reshape(2, 2)
        assert not torch.isfinite(t.float()).all()  # really non-finite
        with pytest.raises(CheckpointTensorError, match=r"w: holds 1 NaN/inf"):
            check_fp8_tensor("w", t, dtype=dtype, shape=(2, 2))
    # the largest finite codes pass: 0x7E (448) for e4m3fn, 0x7B (57344) for e5m2
    top = torch.tensor([0x7E if dtype == E4M3 else 0x7B], dtype=torch.uint8).view(dtype)
    assert float(top.float()) == torch.finfo(dtype).max
    check_fp8_tensor("w", top, dtype=dtype, shape=(1,))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_nonfinite_codes_found_at_every_byte_position(dtype):
    # 8-byte words and a ragged tail: every position of a word (the top byte's carry wraps)
    rng = torch.Generator().manual_seed(0)
    finite = (torch.randn(43, generator=rng) * 100).to(dtype)
    assert torch.isfinite(finite.float()).all()
    check_fp8_tensor("w", finite, dtype=dtype, shape=(43,))
    bad_byte = 0xFF  # NaN in both formats (sign set, all exponent and mantissa bits set)
    for pos in range(43):
        raw = finite.view(torch.uint8).clone()
        raw[pos] = bad_byte
        with pytest.raises(CheckpointTensorError, match="holds 1 NaN/inf"):
            check_fp8_tensor("w", raw.view(dtype), dtype=dtype, shape=(43,))
    # a non-contiguous view is scanned too
    raw = finite.view(torch.uint8).clone()
    raw[2] = bad_byte
    with pytest.raises(CheckpointTensorError):
        check_fp8_tensor("w", raw.view(dtype)[::2], dtype=dtype, shape=(22,))


def test_meta_tensors_skip_values_not_dtype():
    check_fp8_tensor("w", torch.empty(2, 2, dtype=E4M3, device="meta"), dtype=E4M3, shape=(2, 2))
    check_scale_tensor("s", torch.empty(1, device="meta"), shape=(1,))
    with pytest.raises(CheckpointTensorError):
        check_scale_tensor("s", torch.empty(1, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (float("nan"), "non-finite"),
        (float("inf"), "non-finite"),
        (0.0, "must be > 0"),
        (-0.5, "must be > 0"),
    ],
)
def test_bad_scale_values(value, pattern):
    t = torch.tensor([[1.0], [value]])
    with pytest.raises(CheckpointTensorError, match=rf"blk\.weight_scale: .*{pattern}"):
        check_scale_tensor("blk.weight_scale", t, shape=(2, 1))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.bfloat16, torch.float64])
def test_scale_dtype(dtype):
    with pytest.raises(CheckpointTensorError, match=rf"s: a scale must be float32, found {dtype}"):
        check_scale_tensor("s", torch.ones(1, dtype=dtype), shape=(1,))


def test_scale_shape():
    with pytest.raises(CheckpointTensorError, match=r"expected scale shape \(3, 1\), found \(1,\)"):
        check_scale_tensor("s", torch.ones(1), shape=(3, 1))
    with pytest.raises(CheckpointTensorError, match="expected scale shape"):
        check_scale_tensor("s", torch.tensor(1.0), shape=(3, 1))  # scalars only stand in for [1]


def test_max_scale_bound():
    # reference: min(dtype max, 2**64) over the fp8 max, from the published constants
    assert max_scale(E4M3, torch.float16) == pytest.approx(65504.0 / 448.0)
    assert max_scale(E4M3, torch.bfloat16) == pytest.approx(2.0**64 / 448)
    assert max_scale(E5M2, torch.float32) == pytest.approx(2.0**64 / 57344)
    bound = max_scale(E4M3, torch.bfloat16)
    check_scale_tensor("s", torch.tensor([bound * 0.99]), max_value=bound)
    with pytest.raises(CheckpointTensorError, match=r"s: scale .* exceeds the sane bound"):
        check_scale_tensor("s", torch.tensor([1e-3 * 1e30]), max_value=bound)
    # an fp16 activation of 2000 (real outliers reach that) is within the fp16 bound
    check_scale_tensor("s", torch.tensor([2000 / 448]), max_value=max_scale(E4M3, torch.float16))
