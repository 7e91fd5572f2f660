"""Reviewer R31 F5, F13: ``Fp8Config`` field checks.

F5: ``activation_scales={name: None}`` was accepted (the validator said "or None"); the layer
got no scale (not the ``activation_scale`` fallback), its forward failed, and the saved model
could not be reloaded. Refused now, naming the key and the fixes.
F13: a misspelt or foreign ``quantization_config`` key got "written by a newer hf-fp8 ...
upgrade" advice; the closest accepted field is named now, upgrade only when none is close."""

from __future__ import annotations

import json

import pytest

from hf_fp8 import Fp8Config

KEY = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("fallback", [0.05, None])
def test_a_none_activation_scales_entry_is_refused_naming_key_and_fix(fallback) -> None:
    with pytest.raises(
        ValueError, match=rf"activation_scales\['{KEY}'\] is None.*Remove the entry"
    ):
        Fp8Config("static", activation_scale=fallback, activation_scales={KEY: None})


def test_a_json_null_entry_is_dropped_on_load_with_a_warning() -> None:
    """R35: older hf-fp8 saved None entries (with the layer's scale stored in the tensors);
    refusing them made those checkpoints unloadable: a loaded config drops them, warning."""
    saved = json.loads(
        json.dumps({**Fp8Config("static").to_dict(), "activation_scales": {KEY: None}})
    )
    with pytest.warns(UserWarning, match="None"):
        config = Fp8Config.from_dict(saved)
    assert config.activation_scales is None
    assert config.activation_scale_for(KEY) is None  # the stored tensor, else calibrate


def test_entries_must_be_numbers_and_the_message_no_longer_offers_none() -> None:
    with pytest.raises(ValueError) as err:
        Fp8Config("static", activation_scales={KEY: "0.05"})
    assert "or None" not in str(err.value) and "positive finite number" in str(err.value)
    config = Fp8Config("static", activation_scale=0.05, activation_scales={KEY: 0.02})
    assert config.activation_scale_for(KEY) == 0.02
    assert config.activation_scale_for("model.layers.1.mlp.up_proj") == 0.05
    assert Fp8Config("static", activation_scale=0.05).activation_scale is not None  # unchanged


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("activation_schme", "did you mean 'activation_scheme'"),
        ("Weight_Granularity", "did you mean 'weight_granularity'"),
        ("weight_block_size", "block_size=[rows, cols] with weight_granularity='block'"),
        ("modules_to_not_converts", "did you mean 'modules_to_not_convert'"),
    ],
)
def test_a_typo_or_foreign_key_names_the_closest_field_not_upgrade(key: str, hint: str) -> None:
    saved = {**Fp8Config().to_dict(), key: "x"}
    with pytest.raises(ValueError) as err:
        Fp8Config.from_dict(saved)
    text = str(err.value)
    assert key in text and hint in text
    assert "upgrade" not in text.lower()
    assert all(field in text for field in Fp8Config.fields())  # the accepted fields


def test_a_far_key_still_says_upgrade() -> None:
    saved = {**Fp8Config().to_dict(), "zzz_future_option": 1, "activation_schme": "static"}
    with pytest.raises(ValueError) as err:
        Fp8Config.from_dict(saved)
    text = str(err.value)
    assert "did you mean 'activation_scheme'" in text
    assert "['zzz_future_option']" in text and "upgrade hf-fp8" in text


def test_a_typo_in_the_constructor_names_the_closest_field() -> None:
    with pytest.raises(TypeError, match="did you mean 'activation_scheme'"):
        Fp8Config(activation_schme="static")


def test_fields_are_the_saved_keys() -> None:
    config = Fp8Config("static", activation_scale=0.05)
    assert set(Fp8Config.fields()) == set(config.to_dict())
    assert Fp8Config.from_dict(config.to_dict()) == config
