"""compressed-tensors exports of MoE models that vLLM's fused-MoE loader can load (reviewer
R2 F7), and high-precision experts listed in the exports' ``ignore`` lists.

``vllm_fused_moe_accepts`` restates, from vLLM's source, which FP8 weight / activation pairs
``CompressedTensorsW8A8Fp8MoEMethod.__init__`` (``compressed_tensors_moe_w8a8_fp8.py``)
accepts: tensor weights with tensor activations, channel weights with dynamic token
activations, block weights; any other pair fails its ``assert ... == BLOCK`` (static token:
``ValueError``). FP8 weight-only experts reach no fused-MoE method at all.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.moe_fixtures import tiny_qwen3_moe

EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")

# recipes whose compressed-tensors pair vLLM's fused-MoE loader refuses / loads
REFUSED = {
    "static-row (README default)": {"activation_scheme": "static", "activation_scale": 0.02},
    "dynamic-tensor-token": {"activation_scheme": "dynamic", "weight_granularity": "tensor"},
    "dynamic-row-tensor": {"activation_scheme": "dynamic", "activation_granularity": "tensor"},
    "dynamic-row-group": {
        "activation_scheme": "dynamic",
        "activation_granularity": "block",
        "block_size": [32, 32],
    },
}
ACCEPTED = {
    "dynamic-row-token": {"activation_scheme": "dynamic"},
    "static-tensor": {
        "activation_scheme": "static",
        "weight_granularity": "tensor",
        "activation_scale": 0.02,
    },
    "dynamic-tensor-tensor": {
        "activation_scheme": "dynamic",
        "weight_granularity": "tensor",
        "activation_granularity": "tensor",
    },
    "dynamic-block": {"activation_scheme": "dynamic", "weight_granularity": "block"},
}


def vllm_fused_moe_accepts(group: dict) -> bool:
    """vLLM's rule for one compressed-tensors config group on a FusedMoE layer."""
    weights, acts = group["weights"], group.get("input_activations")
    if acts is None:
        return False
    w, a = weights["strategy"], acts["strategy"]
    if w == "tensor" and a == "tensor":
        return True
    if w == "channel" and a == "token":
        return bool(acts["dynamic"])
    return w == "block"


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "hp"
    tiny_qwen3_moe().save_pretrained(path)
    return path


def _quantized(path, kwargs: dict):
    kwargs = dict(kwargs)
    config = Fp8Config(kwargs.pop("activation_scheme"), **kwargs)
    return tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config
    ).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", list(REFUSED))
def test_fp8_experts_in_a_pair_vllm_refuses_are_refused(name, moe_dir, tiny_model_dir, tmp_path):
    # the pair hf_fp8 writes for this recipe (dense model: unchanged, still exported) ...
    dense = export_checkpoint(
        _quantized(tiny_model_dir("llama"), REFUSED[name]), tmp_path / "dense", "compressed-tensors"
    )
    assert not vllm_fused_moe_accepts(_config(dense)["config_groups"]["group_0"])
    # ... is refused for FP8 experts, naming recipes that load and the high-precision option
    with pytest.raises(ValueError, match="vLLM's fused-MoE loader") as err:
        export_checkpoint(_quantized(moe_dir, REFUSED[name]), tmp_path / "ct", "compressed-tensors")
    message = str(err.value)
    assert "model.layers.0.mlp.experts" in message
    assert 'Fp8Config("dynamic")' in message and "modules_to_not_convert" in message
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_fp8_experts_in_a_pair_vllm_loads_are_exported(name, moe_dir, tmp_path):
    out = export_checkpoint(
        _quantized(moe_dir, ACCEPTED[name]), tmp_path / "ct", "compressed-tensors"
    )
    assert vllm_fused_moe_accepts(_config(out)["config_groups"]["group_0"])


def test_weight_only_experts_export_warns_that_vllm_cannot_load_them(moe_dir, tmp_path):
    """transformers loads FP8 weight-only experts (tests/integration/test_moe_quantizer.py);
    vLLM's fused MoE has no FP8 weight-only method: exported, with a warning."""
    model = _quantized(moe_dir, {"activation_scheme": "weight_only"})
    with pytest.warns(UserWarning, match="vLLM's fused-MoE loader"):
        out = export_checkpoint(model, tmp_path / "ct", "compressed-tensors")
    assert not vllm_fused_moe_accepts(_config(out)["config_groups"]["group_0"])


def _hp_experts(layers, num_experts: int = 4) -> list[str]:
    return sorted(
        f"model.layers.{i}.mlp.experts.{e}.{p}_proj"
        for i in layers
        for e in range(num_experts)
        for p in ("gate", "up", "down")
    )


@pytest.mark.parametrize(
    ("skip", "hp_layers"),
    [(["experts"], (0, 1)), (["model.layers.0.mlp.experts"], (0,))],
    ids=["all-experts", "layer-0-experts"],
)
@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [
        ("compressed-tensors", {"activation_scheme": "dynamic"}),
        ("vllm-fp8", {"activation_scheme": "static", "weight_granularity": "tensor"}),
    ],
)
def test_high_precision_experts_are_ignored_and_round_trip(
    skip, hp_layers, fmt, kwargs, moe_dir, tmp_path
):
    """Known issue: experts kept in high precision were missing from ``ignore`` /
    ``ignored_layers`` (vLLM then expects FP8 experts), and the import quantized them."""
    kwargs = {**kwargs, "modules_to_not_convert": skip}
    if kwargs["activation_scheme"] == "static":
        kwargs["activation_scale"] = 0.02
    model = _quantized(moe_dir, kwargs)
    out = export_checkpoint(model, tmp_path / "out", fmt)
    qc = _config(out)
    listed = qc["ignore"] if fmt == "compressed-tensors" else qc["ignored_layers"]
    assert sorted(n for n in listed if EXPERTS.match(n)) == _hp_experts(hp_layers)
    assert "lm_head" in listed

    back = tf.AutoModelForCausalLM.from_pretrained(import_checkpoint(out, tmp_path / "back"))
    for i, layer in enumerate(back.model.layers):
        assert isinstance(layer.mlp.experts, Fp8Experts) == (i not in hp_layers)
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, model(_ids()).logits)


def test_high_precision_experts_make_the_readme_default_exportable(moe_dir, tmp_path):
    """The option the refusal names: static per-row with experts kept in high precision."""
    kwargs = {**REFUSED["static-row (README default)"], "modules_to_not_convert": ["experts"]}
    out = export_checkpoint(_quantized(moe_dir, kwargs), tmp_path / "ct", "compressed-tensors")
    assert sorted(n for n in _config(out)["ignore"] if EXPERTS.match(n)) == _hp_experts((0, 1))
