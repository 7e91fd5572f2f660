"""Fp8Config: defaults, validation that names the accepted values, JSON round trips."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model

ALL_RECIPES = [
    Fp8Config(),
    Fp8Config("weight_only"),
    Fp8Config("weight_only", weight_granularity="block", block_size=[64, 32]),
    Fp8Config("dynamic", weight_granularity="tensor", activation_granularity="tensor"),
    Fp8Config("dynamic", weight_granularity="block"),
    Fp8Config("static", activation_scale=0.05, activation_scales={"model.q_proj": 0.1}),
    Fp8Config("static", fp8_format="e5m2", modules_to_not_convert=["lm_head"], kernel="emulated"),
    Fp8Config("dynamic", dequantize=True),
]


def test_defaults() -> None:
    config = Fp8Config()
    assert config.quant_method == "hf_fp8"
    assert config.activation_scheme == "dynamic"
    assert config.weight_granularity == "row"
    assert config.activation_granularity == "token"
    assert config.fp8_format == "e4m3"
    assert config.block_size == [128, 128]
    assert config.kernel == "auto"
    assert config.modules_to_not_convert is None
    assert config.activation_scale is None and config.activation_scales is None
    assert config.dequantize is False


@pytest.mark.parametrize(
    ("scheme", "granularity", "expected"),
    [
        ("dynamic", "row", "token"),
        ("dynamic", "tensor", "token"),
        ("dynamic", "block", "block"),
        ("static", "row", "tensor"),
        ("weight_only", "row", None),
    ],
)
def test_default_activation_granularity(scheme, granularity, expected) -> None:
    assert Fp8Config(scheme, weight_granularity=granularity).activation_granularity == expected


@pytest.mark.parametrize("config", ALL_RECIPES, ids=lambda c: c.activation_scheme)
def test_json_round_trip(config: Fp8Config) -> None:
    as_dict = config.to_dict()
    assert Fp8Config.from_dict(as_dict) == config
    assert Fp8Config.from_dict(as_dict).to_dict() == as_dict
    text = config.to_json_string(use_diff=False)
    assert Fp8Config.from_dict(json.loads(text)) == config
    assert json.loads(config.to_json_string())["quant_method"] == "hf_fp8"


def test_to_json_file_round_trip(tmp_path) -> None:
    config = ALL_RECIPES[5]
    path = tmp_path / "quantization_config.json"
    config.to_json_file(path)
    assert Fp8Config.from_dict(json.loads(path.read_text())) == config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"activation_scheme": "int8"},
            r"activation_scheme='int8'.*'dynamic', 'static', 'weight_only'",
        ),
        (
            {"weight_granularity": "channel"},
            r"weight_granularity='channel'.*'tensor', 'row', 'block'",
        ),
        (
            {"activation_granularity": "row"},
            r"activation_granularity='row'.*'tensor', 'token', 'block'",
        ),
        ({"fp8_format": "e4m3fnuz"}, r"fp8_format='e4m3fnuz'.*'e4m3', 'e5m2'"),
        ({"kernel": "triton"}, r"kernel='triton'.*'auto', 'scaled_mm', 'emulated'"),
        ({"block_size": [128]}, "block_size must be two positive ints"),
        ({"block_size": [0, 128]}, "block_size must be two positive ints"),
        ({"activation_scale": 0.1}, "only used with activation_scheme='static'"),
        ({"activation_scheme": "static", "activation_scale": -1.0}, "positive finite"),
        (
            {"activation_scheme": "static", "activation_scales": {"a": float("inf")}},
            "positive finite",
        ),
        (
            {"activation_scheme": "static", "activation_granularity": "token"},
            "static activation scales are per tensor",
        ),
        ({"activation_scheme": "weight_only", "activation_granularity": "token"}, "must be None"),
        ({"quant_method": "fp8"}, "quant_method must be 'hf_fp8'"),
    ],
)
def test_invalid_values_name_the_accepted_ones(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Fp8Config(**kwargs)


def test_equality() -> None:
    assert Fp8Config("static") == Fp8Config("static")
    assert Fp8Config("static") != Fp8Config("dynamic")
    assert Fp8Config() != {"quant_method": "hf_fp8"}


def test_linear_kwargs_build_the_same_module() -> None:
    config = Fp8Config(
        "static", weight_granularity="block", block_size=(64, 64), activation_scale=0.5,
        activation_scales={"layers.0.q": 0.25}, kernel="emulated",
    )  # fmt: skip
    kwargs = config.linear_kwargs("layers.0.q")
    assert kwargs == {
        "activation_scheme": "static",
        "weight_granularity": "block",
        "activation_granularity": "tensor",
        "fp8_format": "e4m3",
        "block_size": (64, 64),
        "kernel": "emulated",
        "input_scale": 0.25,
    }
    assert config.linear_kwargs("other")["input_scale"] == 0.5
    module = Fp8Linear.from_linear(nn.Linear(130, 70), config, module_name="layers.0.q")
    assert module.weight_scale.shape == (2, 3) and module.kernel == "emulated"
    assert module.input_scale.item() == 0.25


def test_quantize_model_uses_the_same_config_and_skips_modules(monkeypatch) -> None:
    monkeypatch.setenv("HF_FP8_COMPILE", "0")  # eager emulation: no compile in this test
    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    model.add_module("lm_head", nn.Linear(16, 8))
    model.add_module("lm_head2", nn.Linear(8, 8))
    config = Fp8Config("weight_only", modules_to_not_convert=["lm_head"])
    quantize_model(model, config)
    assert isinstance(model.encoder[0], Fp8Linear) and isinstance(model.encoder[2], Fp8Linear)
    assert type(model.lm_head) is nn.Linear
    assert isinstance(model.lm_head2, Fp8Linear)
    assert model.encoder[0].activation_scheme == "weight_only"
    out = model(torch.randn(3, 16))
    assert out.shape == (3, 8) and bool(torch.isfinite(out).all())


def test_weight_scale_method_is_validated_and_round_trips() -> None:
    config = Fp8Config("weight_only", weight_scale_method="mse")
    assert Fp8Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="absmax"):
        Fp8Config(weight_scale_method="max")


def test_json_on_disk_is_unchanged() -> None:
    """The saved quantization_config keeps its plain-string layout (no recipe object)."""
    config = Fp8Config("static", weight_granularity="block", activation_scale=0.5)
    assert json.loads(config.to_json_string(use_diff=False)) == {
        "quant_method": "hf_fp8",
        "activation_scheme": "static",
        "weight_granularity": "block",
        "activation_granularity": "tensor",
        "fp8_format": "e4m3",
        "block_size": [128, 128],
        "kernel": "auto",
        "weight_scale_method": "absmax",
        "modules_to_not_convert": None,
        "activation_scale": 0.5,
        "activation_scales": None,
        "dequantize": False,
    }
    assert set(config.to_dict()) == set(Fp8Config.fields())
    assert dict(config) == config.to_dict()


def test_the_recipe_inside_is_resolved_once_and_typed() -> None:
    config = Fp8Config("dynamic", weight_granularity="block", fp8_format="e5m2")
    recipe = config.recipe
    assert recipe.activation_granularity.layout == "block" and recipe.block_size == (128, 128)
    assert recipe.fp8_format == "e5m2" and config.recipe is recipe


def test_config_is_immutable_except_the_loading_attributes() -> None:
    config = Fp8Config("static", activation_scale=0.5)
    for field, value in [("activation_scheme", "dynamic"), ("modules_to_not_convert", ["x"]),
                         ("block_size", [64, 64]), ("activation_scale", 2.0)]:  # fmt: skip
        with pytest.raises(AttributeError, match=rf"immutable.*replace\({field}="):
            setattr(config, field, value)
    assert config.activation_scheme == "static" and config.activation_scale == 0.5
    config.kernel = "emulated"  # a loading attribute: validated, and the recipe follows
    assert config.kernel == "emulated" and config.recipe.kernel == "emulated"
    with pytest.raises(ValueError, match=r"kernel='cuda'.*'auto', 'scaled_mm', 'emulated'"):
        config.kernel = "cuda"
    config.dequantize = True
    assert config.dequantize is True
    with pytest.raises(ValueError, match=r"dequantize must be a bool.*got 1 \(int\)"):
        config.dequantize = 1
    assert config.dequantize is True
    other = config.replace(activation_scheme="dynamic", activation_scale=None)
    assert other.recipe.activation_granularity == "token" and config.activation_scheme == "static"
    assert config.replace(activation_scheme="weight_only", activation_scale=None).recipe == (
        Fp8Config("weight_only", kernel="emulated").recipe
    )
    with pytest.raises(ValueError, match="positive finite"):
        config.replace(activation_scale=0.0)


def test_transformers_overrides_the_loading_attributes_of_a_saved_config() -> None:
    from transformers.quantizers.auto import AutoHfQuantizer

    saved = Fp8Config("dynamic", modules_to_not_convert=["lm_head"]).to_dict()
    merged = AutoHfQuantizer.merge_quantization_configs(
        saved, Fp8Config(dequantize=True, kernel="emulated")
    )
    assert merged.dequantize is True and merged.kernel == "emulated"
    assert merged.recipe.kernel == "emulated" and merged.modules_to_not_convert == ["lm_head"]


def test_an_unknown_saved_field_names_it_and_says_upgrade() -> None:
    saved = {**Fp8Config().to_dict(), "expert_granularity": "row", "zz": 1}
    with pytest.raises(ValueError, match=r"\['expert_granularity', 'zz'\].*[Uu]pgrade hf-fp8"):
        Fp8Config.from_dict(saved)
    from transformers.quantizers.auto import AutoQuantizationConfig

    with pytest.raises(ValueError, match="expert_granularity"):
        AutoQuantizationConfig.from_dict(saved)


# -- wrong types are refused, never converted (DESIGN §2.6; review R2 F6) ------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dequantize": "false"}, r"dequantize must be a bool \(True or False\), got 'false'"),
        ({"dequantize": 0}, r"dequantize must be a bool.*got 0 \(int\)"),
        ({"dequantize": None}, r"dequantize must be a bool"),
        (
            {"modules_to_not_convert": "mlp"},
            r"modules_to_not_convert must be a list of module names.*"
            r"got 'mlp' \(str\); for one name write \['mlp'\]",
        ),
        ({"modules_to_not_convert": {"mlp"}}, r"must be a list of module names.*\(set\)"),
        ({"modules_to_not_convert": ["lm_head", 3]}, r"modules_to_not_convert\[1\]=3 is not a str"),
        ({"modules_to_not_convert": [""]}, r"modules_to_not_convert\[0\]='' is an empty name"),
        ({"modules_to_not_convert": ["lm_head", " "]}, r"\[1\]=' ' is an empty name"),
        ({"weight_granularity": "block", "block_size": [32.7, 64.9]}, r"block_size must be two"),
        ({"weight_granularity": "block", "block_size": [32.0, 64.0]}, r"not float or bool"),
        ({"weight_granularity": "block", "block_size": [True, 64]}, r"block_size must be two"),
        ({"block_size": "64"}, r"block_size must be two positive ints.*got '64'"),
        ({"block_size": "12"}, r"block_size must be two positive ints"),
        ({"block_size": 128}, r"block_size must be two positive ints.*got 128"),
        ({"block_size": ["128", "128"]}, r"block_size must be two positive ints"),
        ({"block_size": [128, 128, 1]}, r"block_size must be two positive ints"),
        (
            {"activation_scheme": "static", "activation_scales": [0.1]},
            r"activation_scales must be a dict \{module name: positive finite float\}.*"
            r"got \[0\.1\] \(list\).*activation_scale=",
        ),
        (
            {"activation_scheme": "static", "activation_scales": {"a.q": "0.1"}},
            r"activation_scales\['a.q'\] must be a positive finite number.*got '0.1' \(str\)",
        ),
        (
            {"activation_scheme": "static", "activation_scales": {"a.q": True}},
            r"activation_scales\['a.q'\] must be a positive finite number",
        ),
        (
            {"activation_scheme": "static", "activation_scales": {1: 0.1}},
            r"activation_scales key 1 is not a module name",
        ),
        (
            {"activation_scheme": "static", "activation_scales": {"": 0.1}},
            r"activation_scales key '' is not a module name",
        ),
        (
            {"activation_scheme": "static", "activation_scales": {"a.q": float("nan")}},
            "positive finite",
        ),
        (
            {"activation_scheme": "static", "activation_scale": "0.05"},
            r"activation_scale must be a positive finite number.*got '0.05' \(str\)",
        ),
        ({"activation_scheme": "static", "activation_scale": True}, r"activation_scale must be"),
    ],
)
def test_wrong_types_are_refused_not_converted(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Fp8Config(**kwargs)


def test_a_saved_config_with_a_quoted_bool_is_refused() -> None:
    """config.json ``"dequantize": "false"`` used to load the FP8 checkpoint dequantized."""
    saved = {**Fp8Config().to_dict(), "dequantize": "false"}
    with pytest.raises(ValueError, match=r"dequantize must be a bool.*without quotes"):
        Fp8Config.from_dict(json.loads(json.dumps(saved)))


def test_accepted_forms_round_trip_through_json() -> None:
    import numpy as np

    config = Fp8Config(
        "static", weight_granularity="block", block_size=(np.int64(64), 32),
        modules_to_not_convert=("lm_head", "model.layers.0.mlp"), activation_scale=np.float32(0.5),
        activation_scales={"a.q": 1, "b.experts.down_proj": 0.25}, dequantize=False,
    )  # fmt: skip
    assert config.block_size == [64, 32] and type(config.block_size[0]) is int
    assert config.modules_to_not_convert == ["lm_head", "model.layers.0.mlp"]
    assert config.activation_scales == {"a.q": 1.0, "b.experts.down_proj": 0.25}
    assert type(config.activation_scale) is float and config.activation_scale == 0.5
    loaded = Fp8Config.from_dict(json.loads(config.to_json_string(use_diff=False)))
    assert loaded == config and loaded.to_dict() == config.to_dict()
    assert loaded.recipe.block_size == (64, 32)
    assert Fp8Config(modules_to_not_convert=[]).modules_to_not_convert == []
    assert Fp8Config("static", activation_scales={}).activation_scales is None
