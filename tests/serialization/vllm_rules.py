"""vLLM's rules for the ``ignore`` / ``ignored_layers`` lists of MoE layers, restated from its
source (learned, not copied) so that tests can judge an export without vLLM installed.

* compressed-tensors, current vLLM: ``CompressedTensorsMoEMethod.get_moe_method`` asks
  ``should_ignore_layer`` about ``<layer>.0.gate_proj``, ``<layer>.0.up_proj`` and
  ``<layer>.0.down_proj`` (these three names whatever the family calls its projections);
  ``ignore`` entries match a name exactly, or as a regex after ``re:`` (``re.match``).
* compressed-tensors, earlier vLLM: ``get_quant_method`` asks about the layer name itself.
* vLLM ``fp8`` (``quant_utils.is_layer_skipped``): a layer name containing ``experts`` is
  skipped when it is a substring of an ``ignored_layers`` entry that contains ``experts``.

``<layer>`` is vLLM's FusedMoE prefix, which follows the checkpoint's tensor names.
"""

from __future__ import annotations

import re

CT_MOE_PROBES = (".0.gate_proj", ".0.up_proj", ".0.down_proj")


def _ct_matches(name: str, ignore: list[str]) -> bool:
    return any(
        re.match(entry[3:], name) if entry.startswith("re:") else entry == name for entry in ignore
    )


def ct_ignores_moe(ignore: list[str], layer: str) -> bool:
    """Current vLLM: the layer runs unquantized (raises in vLLM if the probes disagree)."""
    hits = {_ct_matches(layer + probe, ignore) for probe in CT_MOE_PROBES}
    assert len(hits) == 1, f"vLLM raises: the projections of {layer} disagree in ignore"
    return hits.pop()


def ct_old_ignores_moe(ignore: list[str], layer: str) -> bool:
    """Earlier vLLM: the layer name itself is in ``ignore``."""
    return _ct_matches(layer, ignore)


def fp8_skips_moe(ignored_layers: list[str], layer: str) -> bool:
    """vLLM ``fp8``: ``is_layer_skipped`` for a FusedMoE prefix."""
    return any(layer in entry for entry in ignored_layers if "experts" in entry)
