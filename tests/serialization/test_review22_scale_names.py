"""Reviewer R22 F3: a foreign checkpoint that stores one scale under both of its names
(vLLM's ``weight_scale`` next to transformers' ``weight_scale_inv``, ``input_scale`` next to
``activation_scale``) was imported keeping whichever name sorted last: silently wrong. It is
refused, naming both tensors, before anything is written; inspect says the same."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from tests.serialization.helpers import quantized
from tests.serialization.moe_fixtures import tiny_qwen3_moe, write_fp8_block_checkpoint

L = "model.layers.0.mlp.down_proj"
P = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def vllm_dirs(tiny_model_dir, tmp_path_factory):
    """vLLM ``fp8`` exports of the tiny llama: dynamic and static, per-tensor weights."""
    out = {}
    for scheme in ("dynamic-tensor-token", "static-tensor"):
        model = quantized(tiny_model_dir("llama"), scheme)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[scheme] = export_checkpoint(
                model, tmp_path_factory.mktemp(scheme) / "vllm", "vllm-fp8"
            )
    return out


def _copy_with(src, dst, extra: dict[str, torch.Tensor]):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize(
    ("scheme", "stored", "alias"),
    [
        ("dynamic-tensor-token", "weight_scale", "weight_scale_inv"),
        ("static-tensor", "input_scale", "activation_scale"),
    ],
)
def test_both_names_of_one_scale_are_refused(vllm_dirs, tmp_path, scheme, stored, alias):
    src = vllm_dirs[scheme]
    tensors = load_file(src / "model.safetensors")
    # the alias holds a different (valid) number: keeping either one silently is wrong
    extra = {f"{L}.{alias}": tensors[f"{L}.{stored}"] * 2}
    _copy_with(src, tmp_path / "both", extra)
    out = tmp_path / "imported"
    with pytest.raises(ValueError) as err:
        import_checkpoint(tmp_path / "both", out)
    assert f"{L}.{stored}" in str(err.value) and f"{L}.{alias}" in str(err.value)
    assert not out.exists()
    with pytest.raises(ValueError) as err:
        inspect_checkpoint(tmp_path / "both")
    assert f"{L}.{stored}" in str(err.value) and f"{L}.{alias}" in str(err.value)


def test_the_one_name_still_imports(vllm_dirs, tmp_path):
    """Control: the export itself imports, with the stored scale."""
    src = vllm_dirs["dynamic-tensor-token"]
    out = import_checkpoint(src, tmp_path / "imported")
    got = load_file(out / "model.safetensors")[f"{L}.weight_scale"]
    want = load_file(src / "model.safetensors")[f"{L}.weight_scale"]
    assert got.reshape(()).item() == want.item()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "fp8"
    write_fp8_block_checkpoint(tiny_qwen3_moe(), out)
    return out


def _shard(dst, parts: list[dict[str, torch.Tensor]], config: str) -> None:
    dst.mkdir()
    (dst / "config.json").write_text(config)
    weight_map = {}
    for i, part in enumerate(parts, 1):
        file = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("sharded", [False, True])
def test_expert_scale_under_both_names_is_refused(moe_dir, tmp_path, sharded):
    """The per-expert linears that ExpertMerger fuses: same shard, or the two names in two
    shards (the merger takes both in, so no output key repeats)."""
    tensors = load_file(moe_dir / "model.safetensors")
    inv = f"{P}.0.down_proj.weight_scale_inv"
    alias = f"{P}.0.down_proj.weight_scale"
    extra = {alias: tensors[inv] * 2}
    src = tmp_path / "src"
    config = (moe_dir / "config.json").read_text()
    if sharded:
        _shard(src, [tensors, extra], config)
    else:
        _copy_with(moe_dir, src, extra)
    out = tmp_path / "imported"
    with pytest.raises(ValueError) as err:
        import_checkpoint(src, out)
    assert inv in str(err.value) and alias in str(err.value)
    assert not out.exists()
    with pytest.raises(ValueError) as err:
        inspect_checkpoint(src)
    assert inv in str(err.value) and alias in str(err.value)
