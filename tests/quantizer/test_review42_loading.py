"""R42 + the HRM regression of the on-the-fly loading rework (2fff054 .. 2a2894b).

- HRM-text splits its stored ``gqkv_proj`` / ``gate_up_proj`` into several layers (a one-to-many
  WeightConverter): the layers after the first were taken for layers the checkpoint lacks, kept
  as ``nn.Linear`` and the quantize op crashed on them ('Linear' has no fp8_format).
- F1: an FP8 checkpoint whose config.json lost its quantization_config, loaded on the fly with
  a base-model prefix change or a key_mapping, was not refused any more (its fp8 codes were
  quantized again).
- F2: static scales passed at reload fill the input scales of Fp8Experts too.
- F3: unknown layer names in activation_scales passed at reload are refused, as on the fly.
- F4: MoE experts a safetensors float checkpoint lacks: the error names them and the fix.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_fp8 import Fp8Config, quantize_model  # noqa: E402
from hf_fp8.modules import Fp8Linear  # noqa: E402
from hf_fp8.modules.fp8_experts import Fp8Experts  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 17, 3]])


def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False,
    )  # fmt: skip


def _mixtral_config(**kw):
    args = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
    )  # fmt: skip
    args.update(kw)
    return transformers.MixtralConfig(**args)


def _drop_quantization_config(folder) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config")
    config.pop("dtype", None)
    path.write_text(json.dumps(config))


@pytest.mark.skipif(not hasattr(transformers, "HrmTextConfig"), reason="no HRM in transformers")
def test_hrm_split_layers_load_on_the_fly_as_the_float_model_quantized(tmp_path) -> None:
    cfg = transformers.HrmTextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
        num_attention_heads=2, head_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.HrmTextForCausalLM(cfg).save_pretrained(tmp_path / "base")
    q = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=Fp8Config("dynamic")
    ).eval()
    ref = quantize_model(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval(),
        Fp8Config("dynamic"),
    )
    attn = q.model.H_module.layers[15].self_attn
    for name in ("gate_proj", "q_proj", "k_proj", "v_proj"):
        assert isinstance(getattr(attn, name), Fp8Linear), name
    ref_layers = dict(ref.named_modules())
    for name, module in q.named_modules():
        if isinstance(module, Fp8Linear):
            other = ref_layers[name]
            assert torch.equal(module.weight.view(torch.uint8), other.weight.view(torch.uint8)), (
                name
            )
            assert torch.equal(module.weight_scale, other.weight_scale), name
    ids = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        assert torch.equal(q(ids).logits, ref(ids).logits)


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("r42f1")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(root / "float")
    e5m2 = Fp8Config("weight_only", fp8_format="e5m2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM.from_pretrained(
            root / "float", quantization_config=e5m2
        ).save_pretrained(root / "fp8")
        transformers.LlamaModel.from_pretrained(
            root / "float", quantization_config=e5m2
        ).save_pretrained(root / "fp8_base")
    _drop_quantization_config(root / "fp8")
    _drop_quantization_config(root / "fp8_base")
    return root


@pytest.mark.parametrize(
    ("cls", "folder"),
    [("LlamaModel", "fp8"), ("LlamaForCausalLM", "fp8_base")],
    ids=["prefix-stripped", "prefix-added"],
)
def test_fp8_checkpoint_without_its_config_is_refused_across_a_prefix_change(
    fp8_folders, cls, folder
) -> None:
    model_cls = getattr(transformers, cls)
    with pytest.raises(ValueError, match="the checkpoint is already FP8") as refused:
        model_cls.from_pretrained(fp8_folders / folder, quantization_config=Fp8Config("dynamic"))
    assert "_scale" in str(refused.value)
    assert "restore it" in str(refused.value)


def test_fp8_checkpoint_without_its_config_is_refused_under_a_key_mapping(fp8_folders) -> None:
    from safetensors.torch import load_file, save_file

    renamed = fp8_folders / "renamed"
    shutil.copytree(fp8_folders / "fp8", renamed)
    tensors = load_file(renamed / "model.safetensors")
    save_file(
        {k.replace("model.layers.", "model.blocks."): v for k, v in tensors.items()},
        renamed / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match="the checkpoint is already FP8"):
        transformers.LlamaForCausalLM.from_pretrained(
            renamed,
            key_mapping={r"model\.blocks\.": "model.layers."},
            quantization_config=Fp8Config("dynamic"),
        )


def test_float_checkpoint_under_a_key_mapping_loads_as_the_float_model_quantized(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path / "float")
    tensors = load_file(tmp_path / "float" / "model.safetensors")
    # one projection renamed only: the others are found under their own names
    save_file(
        {k.replace("self_attn.q_proj.", "self_attn.query."): v for k, v in tensors.items()},
        tmp_path / "float" / "model.safetensors",
        metadata={"format": "pt"},
    )
    mapping = {r"self_attn\.query\.": "self_attn.q_proj."}
    q = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "float", key_mapping=mapping, quantization_config=Fp8Config("dynamic")
    ).eval()
    ref = quantize_model(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "float", key_mapping=mapping),
        Fp8Config("dynamic"),
    ).eval()
    layer, ref_layer = q.model.layers[0].self_attn.q_proj, ref.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Fp8Linear)
    assert torch.equal(layer.weight.view(torch.uint8), ref_layer.weight.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(q(IDS).logits, ref(IDS).logits)


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("r42moe")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(_mixtral_config()).save_pretrained(root / "float")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.MixtralForCausalLM.from_pretrained(
            root / "float", quantization_config=Fp8Config("static")
        ).save_pretrained(root / "uncalibrated")
    return root


def test_scales_passed_at_reload_fill_the_experts_too(moe_folders) -> None:
    passed = Fp8Config("static", activation_scale=0.05)
    ref = quantize_model(
        transformers.MixtralForCausalLM.from_pretrained(moe_folders / "float").eval(), passed
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = transformers.MixtralForCausalLM.from_pretrained(
            moe_folders / "uncalibrated", quantization_config=passed
        ).eval()
    experts = m.model.layers[0].mlp.experts
    ref_experts = ref.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        scale = getattr(experts, f"{proj}_input_scale")
        assert scale is not None, proj
        assert torch.equal(scale, getattr(ref_experts, f"{proj}_input_scale")), proj
    filled = [str(w.message) for w in caught if "filled the input scales" in str(w.message)]
    # q / k / v / o_proj and the experts (the old code: the 4 linears only)
    assert len(filled) == 1 and "filled the input scales of 5 layer(s)" in filled[0], filled
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, ref(IDS).logits)


def test_unknown_scale_names_passed_at_reload_are_refused(moe_folders) -> None:
    bad = Fp8Config("static", activation_scales={"model.layers.0.self_attn.q_projj": 0.05})
    with pytest.raises(ValueError, match="q_projj") as on_the_fly:
        transformers.MixtralForCausalLM.from_pretrained(
            moe_folders / "float", quantization_config=bad
        )
    with pytest.raises(ValueError, match="q_projj") as reload:
        transformers.MixtralForCausalLM.from_pretrained(
            moe_folders / "uncalibrated", quantization_config=bad
        )
    assert "activation_scales" in str(reload.value)
    assert str(on_the_fly.value).split(":")[0] == str(reload.value).split(":")[0]
    # a known name (an experts module) is accepted at reload
    good = Fp8Config("static", activation_scales={"model.layers.0.mlp.experts.gate_up_proj": 0.05})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = transformers.MixtralForCausalLM.from_pretrained(
            moe_folders / "uncalibrated", quantization_config=good
        )
    experts = m.model.layers[0].mlp.experts
    scale = experts.gate_up_proj_input_scale
    assert torch.equal(scale, torch.full_like(scale, 0.05))
    assert experts.down_proj_input_scale is None


@pytest.mark.parametrize(
    "kw",
    [dict(num_hidden_layers=2), dict(num_local_experts=8), dict(intermediate_size=48)],
    ids=["lacks", "more-experts", "resized"],
)
def test_experts_a_safetensors_float_checkpoint_lacks_are_named_with_the_fix(
    moe_folders, kw
) -> None:
    cfg = transformers.MixtralConfig.from_pretrained(moe_folders / "float", **kw)
    extra = {} if "num_hidden_layers" in kw else {"ignore_mismatched_sizes": True}
    torch.manual_seed(5)
    transformers.MixtralForCausalLM.from_pretrained(moe_folders / "float", config=cfg, **extra)
    with pytest.raises(ValueError, match="modules_to_not_convert") as refused:
        transformers.MixtralForCausalLM.from_pretrained(
            moe_folders / "float",
            config=cfg,
            quantization_config=Fp8Config("dynamic"),
            **extra,
        )
    text = str(refused.value)
    assert "mlp.experts" in text
    assert "Save the checkpoint as safetensors" not in text
    assert "_weight_scale" not in text
    assert "not supported on the fly" in text
    # the fix it names loads: equal to the float model loaded the same way, then quantized
    kept = (
        "model.layers.1.mlp.experts" if "num_hidden_layers" in kw else "model.layers.0.mlp.experts"
    )
    assert f"modules_to_not_convert=['{kept}']" in text
    fixed = Fp8Config("dynamic", modules_to_not_convert=[kept])
    torch.manual_seed(5)
    m = transformers.MixtralForCausalLM.from_pretrained(
        moe_folders / "float", config=cfg, quantization_config=fixed, **extra
    ).eval()
    torch.manual_seed(5)
    flt = transformers.MixtralForCausalLM.from_pretrained(
        moe_folders / "float", config=cfg, **extra
    )
    ref = quantize_model(flt.eval(), fixed)
    assert not isinstance(m.get_submodule(kept), Fp8Experts)
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, ref(IDS).logits)
