"""Fp8Recipe: strings resolved once into a typed, frozen scheme; errors name the accepted words."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hf_fp8.recipe import (
    ACTIVATION_GRANULARITY_TABLE,
    ActivationGranularity,
    ActivationScheme,
    Fp8Format,
    Fp8Recipe,
    Granularity,
    Kernel,
    WeightScaleMethod,
    values,
)


def test_words_compare_format_and_serialize_as_plain_strings() -> None:
    recipe = Fp8Recipe.resolve("dynamic", weight_granularity="row")
    assert recipe.activation_scheme == "dynamic" and recipe.weight_granularity == "row"
    assert f"{recipe.activation_granularity}" == "token" and str(recipe.kernel) == "auto"
    assert json.loads(json.dumps(recipe.to_strings())) == recipe.to_strings()
    assert json.dumps([recipe.fp8_format]) == '["e4m3"]'


@pytest.mark.parametrize("scheme", values(ActivationScheme))
@pytest.mark.parametrize("weights", values(Granularity))
def test_default_is_the_first_accepted_word_and_every_accepted_word_resolves(
    scheme: str, weights: str
) -> None:
    accepted = ACTIVATION_GRANULARITY_TABLE[ActivationScheme(scheme)][Granularity(weights)]
    default = Fp8Recipe.resolve(scheme, weight_granularity=weights).activation_granularity
    assert default == (accepted[0] if accepted else None)
    for act in accepted:
        recipe = Fp8Recipe.resolve(scheme, weight_granularity=weights, activation_granularity=act)
        assert recipe.activation_granularity is act and recipe.quantizes_activations
    for act in set(ActivationGranularity) - set(accepted):
        with pytest.raises(ValueError, match="activation_granularity"):
            Fp8Recipe.resolve(scheme, weight_granularity=weights, activation_granularity=act)


@pytest.mark.parametrize(
    ("scheme", "weights", "expected"),
    [
        ("dynamic", "row", "token"),
        ("dynamic", "tensor", "token"),
        ("dynamic", "block", "block"),
        ("static", "row", "tensor"),
        ("static", "block", "tensor"),
        ("weight_only", "row", None),
    ],
)
def test_documented_defaults(scheme, weights, expected) -> None:
    recipe = Fp8Recipe.resolve(scheme, weight_granularity=weights)
    assert recipe.activation_granularity == expected


def test_token_is_the_row_layout_in_the_numerics() -> None:
    assert Fp8Recipe.resolve("dynamic").activation_layout == "row"
    assert Fp8Recipe.resolve("static").activation_layout == "tensor"
    assert Fp8Recipe.resolve("weight_only").activation_layout is None
    assert Fp8Recipe.resolve(weight_granularity="block").activation_block_size == (1, 128)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"activation_scheme": "int8"}, r"activation_scheme='int8'.*'dynamic', 'static', 'weight_only'"),
        ({"weight_granularity": "channel"}, r"weight_granularity='channel'.*'tensor', 'row', 'block'"),
        ({"activation_granularity": "row"}, r"activation_granularity='row'.*'tensor', 'token', 'block'"),
        ({"fp8_format": "e4m3fnuz"}, r"fp8_format='e4m3fnuz'.*'e4m3', 'e5m2'"),
        ({"kernel": "triton"}, r"kernel='triton'.*'auto', 'scaled_mm', 'emulated'"),
        ({"weight_scale_method": "max"}, r"weight_scale_method='max'.*'absmax', 'mse'"),
        ({"block_size": (128,)}, "block_size must be two positive ints"),
        ({"block_size": (0, 128)}, "block_size must be two positive ints"),
        ({"block_size": ("a", 1)}, "block_size must be two positive ints"),
        ({"activation_scheme": "static", "activation_granularity": "token"}, "per tensor"),
        ({"activation_scheme": "weight_only", "activation_granularity": "token"}, "must be None"),
        ({"activation_scheme": "weight_only", "kernel": "scaled_mm"}, "needs FP8 activations"),
    ],
)  # fmt: skip
def test_errors_name_the_accepted_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Fp8Recipe.resolve(**kwargs)


def test_frozen_hashable_and_typed() -> None:
    recipe = Fp8Recipe.resolve("static", fp8_format="e5m2", block_size=[64, 32], kernel="emulated")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.kernel = Kernel.AUTO  # type: ignore[misc]
    assert recipe == Fp8Recipe.resolve("static", fp8_format=Fp8Format.E5M2, block_size=(64, 32),
                                       kernel="emulated")  # fmt: skip
    assert len({recipe, dataclasses.replace(recipe)}) == 1
    assert recipe.block_size == (64, 32) and isinstance(recipe.kernel, Kernel)
    assert isinstance(recipe.weight_scale_method, WeightScaleMethod) and recipe.is_static


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ValueError, match="must be None"):
        Fp8Recipe(ActivationScheme.WEIGHT_ONLY)  # the default activation granularity is token
    recipe = Fp8Recipe("weight_only", activation_granularity=None)  # type: ignore[arg-type]
    assert recipe.activation_scheme is ActivationScheme.WEIGHT_ONLY
    assert dataclasses.replace(recipe, kernel="emulated").kernel is Kernel.EMULATED


def test_block_size_floats_and_bools_are_refused_even_after_a_cached_equal_key() -> None:
    """The resolve cache compares ``32.0 == 32`` and ``True == 1``: the check runs first."""
    assert Fp8Recipe.resolve("dynamic", weight_granularity="block", block_size=(32, 64))
    assert Fp8Recipe.resolve("dynamic", weight_granularity="block", block_size=(1, 64))
    for bad in ((32.0, 64), [True, 64], (32.7, 64.9), "ab"):
        with pytest.raises(ValueError, match=r"block_size must be two positive ints.*not float"):
            Fp8Recipe.resolve("dynamic", weight_granularity="block", block_size=bad)
        with pytest.raises(ValueError, match="block_size must be two positive ints"):
            Fp8Recipe(block_size=bad)
    assert type(Fp8Recipe(block_size=[64, 32]).block_size) is tuple
