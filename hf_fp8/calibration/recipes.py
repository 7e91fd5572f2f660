"""The recipe a static layer runs under while ``calibrate`` observes its activations."""

from __future__ import annotations

import dataclasses

from hf_fp8.recipe import Fp8Recipe, Kernel


def observing_recipe(recipe: Fp8Recipe) -> Fp8Recipe:
    """``recipe`` run weight-only (high-precision activations reach the observers), same
    storage. A kernel that needs FP8 activations (``scaled_mm``, refused together with
    weight-only) becomes ``auto`` for the observation; ``calibrate`` puts the original
    recipe object back afterwards."""
    kernel = Kernel.AUTO if recipe.kernel is Kernel.SCALED_MM else recipe.kernel
    return dataclasses.replace(
        recipe, activation_scheme="weight_only", activation_granularity=None, kernel=kernel
    )
