"""The recipe words an FP8 module exposes (read by cards, summaries, exports), in one place.

``Fp8Linear`` and ``Fp8Experts`` hold one frozen ``Fp8Recipe`` in ``self.recipe``; these
read-only properties give its words back as plain ``str`` (yaml- and safetensors-safe).
"""

from __future__ import annotations

from hf_fp8.recipe import Fp8Recipe


class RecipeWords:
    """Mixin: plain-string views of ``self.recipe``."""

    recipe: Fp8Recipe

    @property
    def weight_granularity(self) -> str:
        return self.recipe.weight_granularity.value

    @property
    def activation_granularity(self) -> str | None:
        act = self.recipe.activation_granularity
        return None if act is None else act.value

    @property
    def fp8_format(self) -> str:
        return self.recipe.fp8_format.value

    @property
    def block_size(self) -> tuple[int, int]:
        return self.recipe.block_size
