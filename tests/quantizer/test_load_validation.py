"""Every tensor from_pretrained reads from an hf_fp8 checkpoint is validated (issue 12 §2).

Each case saves a tiny FP8 model with hf_fp8, corrupts one tensor (or the config) with
safetensors / json, and expects a ``CheckpointTensorError`` that names the tensor. Before the
checks, every one of these loaded silently and gave NaN or wrong outputs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, TINY, model_inputs, model_output

LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def fp8_dirs(tiny_model_dir, tmp_path_factory):
    """``{scheme: folder}`` of hf_fp8 checkpoints of the tiny Llama, saved once."""
    src = tiny_model_dir("llama")
    out = {"hp": src}
    for scheme, kwargs in {"dynamic": {}, "static": {"activation_scale": 0.05}}.items():
        model = AutoModelForCausalLM.from_pretrained(
            src, quantization_config=Fp8Config(scheme, **kwargs)
        )
        path = tmp_path_factory.mktemp(f"fp8_{scheme}")
        model.save_pretrained(path)
        out[scheme] = str(path)
    return out


def _corrupt(src: str, dst: Path, edit=None, config_edit=None) -> str:
    """Copy checkpoint ``src`` to ``dst``, then ``edit(tensors)`` / ``config_edit(qconfig)``."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _expect_error(path: str, key: str, pattern: str = "", **kwargs) -> CheckpointTensorError:
    with pytest.raises(CheckpointTensorError, match=re.escape(key) + pattern) as info:
        AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return info.value


def _set(key: str, fn):
    def edit(tensors):
        tensors[key] = fn(tensors[key])

    return edit


def _first_row(value: float):
    def fn(t):
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return fn


WEIGHT_SCALE_CASES = {
    "nan": (_first_row(float("nan")), "non-finite"),
    "inf": (_first_row(float("inf")), "non-finite"),
    "zero": (torch.zeros_like, "must be > 0"),
    "negative": (torch.neg, "must be > 0"),
    "x1e30": (lambda t: t * 1e30, "exceeds the sane bound"),
    "int32": (lambda t: t.to(torch.int32), "must be float32, found torch.int32"),
    "float16": (lambda t: t.to(torch.float16), "must be float32, found torch.float16"),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_SCALE_CASES))
def test_bad_weight_scale_is_refused(case, fp8_dirs, tmp_path):
    fn, pattern = WEIGHT_SCALE_CASES[case]
    key = f"{LAYER}.weight_scale"
    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt", _set(key, fn))
    err = _expect_error(path, key, f": .*{pattern}")
    assert key in str(err) and isinstance(err, ValueError)


def test_high_precision_weight_in_fp8_slot_is_refused(fp8_dirs, tmp_path):
    # the loader would cast it to the fp8 meta dtype: codes ~ weights, times a scale ~ 1/448
    hp = load_file(Path(fp8_dirs["hp"]) / "model.safetensors")[f"{LAYER}.weight"]
    key = f"{LAYER}.weight"
    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt", _set(key, lambda t: hp))
    err = _expect_error(path, key, r": expected fp8 e4m3 .*found torch.float32")
    assert key in str(err)


def test_e5m2_bytes_under_e4m3_config_are_refused(fp8_dirs, tmp_path):
    key = f"{LAYER}.weight"
    to_e5m2 = _set(key, lambda t: t.float().to(torch.float8_e5m2))
    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt", to_e5m2)
    err = _expect_error(path, key, r": stored as fp8 e5m2 .*fp8_format='e4m3'")
    assert key in str(err)


def test_config_format_differing_from_stored_dtype_is_refused(fp8_dirs, tmp_path):
    path = _corrupt(
        fp8_dirs["dynamic"],
        tmp_path / "ckpt",
        config_edit=lambda q: q.__setitem__("fp8_format", "e5m2"),
    )
    err = _expect_error(path, ".weight", r": stored as fp8 e4m3 .*fp8_format='e5m2'")
    assert "e5m2" in str(err)


@pytest.mark.parametrize(("value", "pattern"), [(float("nan"), "non-finite"), (0.0, "must be > 0")])
def test_bad_static_input_scale_is_refused(value, pattern, fp8_dirs, tmp_path):
    key = f"{LAYER}.input_scale"
    path = _corrupt(fp8_dirs["static"], tmp_path / "ckpt", _set(key, _first_row(value)))
    err = _expect_error(path, key, f": .*{pattern}")
    assert key in str(err) and isinstance(err, ValueError)


def test_modules_to_not_convert_naming_an_fp8_layer_is_refused(fp8_dirs, tmp_path):
    # fp8 codes must not be read into nn.Linear as plain floats (without their scales)
    path = _corrupt(
        fp8_dirs["dynamic"],
        tmp_path / "ckpt",
        config_edit=lambda q: q.__setitem__("modules_to_not_convert", ["lm_head", "q_proj"]),
    )
    err = _expect_error(path, f"{LAYER}.weight", r": .*FP8 on disk.*modules_to_not_convert")
    assert f"{LAYER}.weight" in str(err)


def test_fp8_checkpoint_without_its_config_is_not_quantized_twice(fp8_dirs, tmp_path):
    # config.json lost its quantization_config: an on-the-fly Fp8Config would re-quantize
    # the fp8 codes as if they were weights, and drop the stored scales
    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt")
    config = json.loads((Path(path) / "config.json").read_text())
    del config["quantization_config"]
    (Path(path) / "config.json").write_text(json.dumps(config))
    err = _expect_error(
        path, ".weight_scale", r": .*already FP8", quantization_config=Fp8Config("dynamic")
    )
    assert "already FP8" in str(err)


@pytest.mark.parametrize("shape", [(1, 1), (1, 64)])
def test_wrong_weight_scale_shape_names_the_key(shape, fp8_dirs, tmp_path):
    key = f"{LAYER}.weight_scale"
    path = _corrupt(
        fp8_dirs["dynamic"],
        tmp_path / "ckpt",
        _set(key, lambda t: t.flatten()[:1].expand(shape).clone()),
    )
    with pytest.raises((RuntimeError, ValueError), match=re.escape(key) + "|ignore_mismatched"):
        AutoModelForCausalLM.from_pretrained(path)
    # ignore_mismatched_sizes never leaves a wrong or uninitialised scale in place
    with pytest.raises(ValueError, match=re.escape(key)):
        AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=True)


def test_nan_fp8_codes_are_refused_when_codes_are_checked(fp8_dirs, tmp_path, monkeypatch):
    # scanning every weight byte costs a full read of the weights: on with HF_FP8_CHECK_CODES=1
    key = f"{LAYER}.weight"

    def nan_code(t):
        raw = t.view(torch.uint8).clone()
        raw.view(-1)[5] = 0x7F  # e4m3fn NaN
        return raw.view(torch.float8_e4m3fn)

    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt", _set(key, nan_code))
    AutoModelForCausalLM.from_pretrained(path)  # default: dtypes, shapes and scales only
    monkeypatch.setenv("HF_FP8_CHECK_CODES", "1")
    err = _expect_error(path, key, ": holds 1 NaN/inf")
    assert key in str(err)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_valid_checkpoints_still_load_exactly(scheme, dtype, fp8_dirs):
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(fp8_dirs[scheme], **kwargs)
    stored = load_file(Path(fp8_dirs[scheme]) / "model.safetensors")
    q = model.get_submodule(LAYER)
    assert isinstance(q, Fp8Linear)
    # what the module holds is bit-identical to the file (no cast on the way in)
    assert torch.equal(q.weight.view(torch.uint8), stored[f"{LAYER}.weight"].view(torch.uint8))
    assert torch.equal(q.weight_scale, stored[f"{LAYER}.weight_scale"])
    if scheme == "static":
        assert torch.equal(q.input_scale, stored[f"{LAYER}.input_scale"])
    assert torch.isfinite(model_output(model, model_inputs("llama"))).all()


@pytest.mark.parametrize("case", ["nan", "x1e30", "int32"])
def test_load_state_dict_runs_the_same_checks(case, fp8_dirs):
    model = AutoModelForCausalLM.from_pretrained(fp8_dirs["dynamic"])
    state = model.state_dict()
    key = f"{LAYER}.weight_scale"
    state[key] = WEIGHT_SCALE_CASES[case][0](state[key])
    with pytest.raises(CheckpointTensorError, match=re.escape(key)):
        model.load_state_dict(state)


def test_input_scale_of_an_all_zero_calibration_warns_at_load(fp8_dirs, tmp_path):
    # hf_fp8 < this fix stored amax_to_scale(0) = 1e-12 / 448 for a layer that saw only
    # zeros: every nonzero input saturates. Such a checkpoint loads with one warning.
    key = f"{LAYER}.input_scale"
    tiny = _set(key, lambda t: torch.full_like(t, 1e-12 / 448))
    path = _corrupt(fp8_dirs["static"], tmp_path / "ckpt", tiny)
    with pytest.warns(UserWarning, match=rf"1 static layer.*{re.escape(LAYER)}.*re-calibrate"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize(
    ("tensor", "fn", "pattern"),
    [
        ("weight_scale", _first_row(float("nan")), "non-finite"),
        ("weight_scale", lambda t: t.to(torch.float16), "must be float32"),
        ("weight", lambda t: t.float().to(torch.float8_e5m2), "stored as fp8 e5m2"),
    ],
)
def test_disk_offloaded_layers_are_checked_too(tensor, fn, pattern, fp8_dirs, tmp_path):
    # offloaded tensors never reach the module (they stay on meta until a forward reads them)
    layer = "model.layers.1.self_attn.q_proj"
    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt", _set(f"{layer}.{tensor}", fn))
    device_map = dict(LLAMA_LAYER_1_ON_DISK)
    err = _expect_error(
        path,
        f"{layer}.{tensor}",
        f": .*{pattern}",
        device_map=device_map,
        offload_folder=str(tmp_path / "offload"),
    )
    assert f"{layer}.{tensor}" in str(err)


def test_float16_compute_dtype_bounds_the_scales(fp8_dirs, tmp_path):
    # a weight of magnitude 1e5 dequantizes to inf in float16 (max 65504), not in bfloat16
    key = f"{LAYER}.weight_scale"
    big = _set(key, lambda t: torch.full_like(t, 1e5 / 448))
    path = _corrupt(fp8_dirs["dynamic"], tmp_path / "ckpt", big)
    err = _expect_error(path, key, r": .*exceeds.*dtype=torch.bfloat16", dtype=torch.float16)
    assert key in str(err)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert float(model.get_submodule(LAYER).weight_scale.max()) == pytest.approx(1e5 / 448)


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5"])
def test_every_family_is_checked(family, tiny_model_dir, tmp_path):

    model_cls = TINY[family][1]
    model = model_cls.from_pretrained(
        tiny_model_dir(family), quantization_config=Fp8Config("dynamic")
    )
    model.save_pretrained(tmp_path / "fp8")
    name = next(n for n, m in model.named_modules() if isinstance(m, Fp8Linear))
    key = f"{name}.weight_scale"
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    stored_key = next(k for k in stored if k.endswith(key))  # the file may add a prefix
    path = _corrupt(str(tmp_path / "fp8"), tmp_path / "ckpt", _set(stored_key, torch.neg))
    with pytest.raises(CheckpointTensorError, match=re.escape(key) + ": .*must be > 0"):
        model_cls.from_pretrained(path)


def test_scale_batch_names_the_bad_tensor_in_any_chunk():
    from hf_fp8.quantizer.validation import ScaleBatch

    batch = ScaleBatch()
    sizes = [5000] * 20  # several fused chunks of <= 32768 values
    for i, n in enumerate(sizes):
        batch.add(f"l{i}.weight_scale", torch.full((n, 1), 0.5), (n, 1), 10.0)
    batch.check()  # all good
    bad = torch.full((5000, 1), 0.5)
    bad[4321, 0] = float("nan")
    batch.add("l20.weight_scale", bad, (5000, 1), 10.0)
    with pytest.raises(CheckpointTensorError, match=r"^l20\.weight_scale: holds 1 non-finite"):
        batch.check()
    over = ScaleBatch()
    over.add("big.weight_scale", torch.tensor([11.0]), (1,), 10.0)
    with pytest.raises(CheckpointTensorError, match=r"big\.weight_scale: scale 11 exceeds"):
        over.check()
