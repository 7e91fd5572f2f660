"""quantize_model: which layers are swapped, and how names are matched."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from hf_fp8.modules import matches_module


@pytest.mark.parametrize(
    ("name", "patterns", "expected"),
    [
        ("lm_head", ["lm_head"], True),
        ("model.lm_head", ["lm_head"], True),
        ("lm_head2", ["lm_head"], False),
        ("model.layers.0.mlp.up_proj", ["layers.0"], True),
        ("model.layers.10.mlp.up_proj", ["layers.1"], False),
        ("model.layers.0.mlp.up_proj", ["mlp.up_proj"], True),
        ("model.layers.0.mlp.up_proj", [], False),
    ],
)
def test_matches_module(name, patterns, expected) -> None:
    assert matches_module(name, patterns) is expected


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(self.q_proj(x)))


def test_swaps_every_linear_except_the_skipped_ones(monkeypatch) -> None:
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    layers = {"b0": Block(), "b1": Block(), "head": nn.Linear(32, 10)}
    model = nn.Sequential(OrderedDict(layers)).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    out_model = quantize_model(model, Fp8Config("weight_only", modules_to_not_convert=["head"]))
    assert out_model is model
    swapped = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert swapped == ["b0.q_proj", "b0.mlp.0", "b0.mlp.2", "b1.q_proj", "b1.mlp.0", "b1.mlp.2"]
    assert type(model.head) is nn.Linear and type(model.b0.norm) is nn.LayerNorm
    assert all(
        m.compute_dtype == torch.bfloat16 for m in model.modules() if isinstance(m, Fp8Linear)
    )
    with torch.no_grad():
        out = model(x)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.05


def test_skip_argument_and_names_passed_to_the_layers() -> None:
    model = nn.Sequential(Block())
    config = Fp8Config("static", activation_scale=1.0, activation_scales={"0.q_proj": 0.5})
    quantize_model(model, config, skip=["mlp"])
    assert isinstance(model[0].q_proj, Fp8Linear) and model[0].q_proj.input_scale.item() == 0.5
    assert type(model[0].mlp[0]) is nn.Linear and type(model[0].mlp[2]) is nn.Linear


def test_non_finite_weight_error_names_the_layer() -> None:
    model = nn.Sequential(Block())
    with torch.no_grad():
        model[0].mlp[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"0\.mlp\.2\.weight"):
        quantize_model(model, Fp8Config())


def test_conv1d_is_swapped_with_a_contiguous_out_by_in_weight(monkeypatch) -> None:
    """GPT-2's Conv1D stores [in, out]; the FP8 weight is stored [out, in] and contiguous
    (the transposed view would be copied by torch._scaled_mm at every call)."""
    from transformers.pytorch_utils import Conv1D

    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(c_fc=Conv1D(48, 32)))
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = model(x)
    quantize_model(model, Fp8Config("weight_only", weight_granularity="tensor"))
    layer = model.c_fc
    assert isinstance(layer, Fp8Linear) and layer.weight.shape == (48, 32)
    assert layer.weight.is_contiguous()
    with torch.no_grad():
        rel = ((model(x) - ref).norm() / ref.norm()).item()
    assert rel < 0.05


def test_an_fp8_model_with_another_scheme_is_refused() -> None:
    """Issue 12 §7: quantizing an FP8 model silently did nothing (or mixed two recipes
    under one saved config)."""
    from hf_fp8.quantizer.convert import AlreadyQuantizedError

    model = nn.Sequential(Block())
    quantize_model(model, Fp8Config("weight_only"), skip=["mlp"])
    with pytest.raises(
        AlreadyQuantizedError,
        match=r"'0\.q_proj': activation_scheme='weight_only' there, 'dynamic' asked",
    ):
        quantize_model(model, Fp8Config("dynamic"))
    assert type(model[0].mlp[0]) is nn.Linear  # nothing was converted by the refused call


def test_the_same_scheme_completes_a_partly_fp8_model_and_warns_when_nothing_is_left() -> None:
    """A LoRA merge leaves merged layers in high precision: quantize_model re-quantizes them."""
    model = nn.Sequential(Block())
    quantize_model(model, Fp8Config("weight_only"), skip=["mlp"])
    first = model[0].q_proj
    quantize_model(model, Fp8Config("weight_only", kernel="emulated"))
    assert model[0].q_proj is first and isinstance(model[0].mlp[0], Fp8Linear)
    with pytest.warns(UserWarning, match="already FP8; nothing to do"):
        quantize_model(model, Fp8Config("weight_only"))


def test_skip_names_that_match_nothing_are_warned_about() -> None:
    """Issue 13 / 12 §6: a typo in modules_to_not_convert / skip was silently ignored."""
    model = nn.Sequential(Block())
    with pytest.warns(UserWarning, match=r"\['lm_haed', 'mlp\.3'\] match\(es\) no module"):
        quantize_model(model, Fp8Config(modules_to_not_convert=["lm_haed"]), skip=["mlp", "mlp.3"])
    assert type(model[0].mlp[0]) is nn.Linear and isinstance(model[0].q_proj, Fp8Linear)


def test_module_filter_fn_and_shared_layers() -> None:
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared),
                           "c": nn.Linear(32, 8)})  # fmt: skip
    quantize_model(model, Fp8Config(), module_filter_fn=lambda m, fqn: m.out_features == 32)
    assert isinstance(model.a[0], Fp8Linear) and model.a[0] is model.b[0]  # still one layer
    assert type(model.c) is nn.Linear


def test_there_is_one_quantize_model() -> None:
    import hf_fp8.modules
    import hf_fp8.modules.replace

    assert not hasattr(hf_fp8.modules, "quantize_model")
    assert not hasattr(hf_fp8.modules.replace, "quantize_model")


@pytest.mark.parametrize("patch", ["forward_hook", "pre_hook", "instance_forward"])
def test_layers_with_hooks_or_a_patched_forward_are_refused_before_anything_converts(patch) -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 32)
    if patch == "forward_hook":  # e.g. an activation capture that scales or records
        block.mlp[0].register_forward_hook(lambda module, args, out: out * 0.0)
    elif patch == "pre_hook":
        block.mlp[0].register_forward_pre_hook(lambda module, args: (args[0] * 0.0,))
    else:  # what accelerate's add_hook_to_module does
        original = block.mlp[0].forward
        block.mlp[0].forward = lambda x: original(x) * 0.0
    with torch.no_grad():
        want = block(x)
    with pytest.raises(ValueError, match=r"mlp\.0: .*(hook|instance forward).*skip="):
        quantize_model(block, Fp8Config("weight_only"))
    assert not any(isinstance(m, Fp8Linear) for m in block.modules())  # nothing half-done
    with torch.no_grad():
        torch.testing.assert_close(block(x), want, rtol=0, atol=0)
    quantize_model(block, Fp8Config("weight_only"), skip=["mlp.0"])  # the named fix works
    assert isinstance(block.q_proj, Fp8Linear) and type(block.mlp[0]) is nn.Linear
