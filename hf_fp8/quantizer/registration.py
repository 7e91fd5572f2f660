"""``register_with_transformers``: kept for callers; the patch lives in ``hf_fp8.patches``."""

from __future__ import annotations


def register_with_transformers() -> None:
    """Make ``quant_method="hf_fp8"`` loadable by ``from_pretrained`` now; safe to call twice.

    ``import hf_fp8`` already does this as soon as transformers' quantizer registry is imported.
    Raises ``RuntimeError`` (naming the public alternative) if transformers' registry changed.
    """
    from hf_fp8.patches import apply

    apply("quantizers", strict=True)
