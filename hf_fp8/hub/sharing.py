"""``hf_fp8.export``: convert to compressed-tensors / vLLM ``fp8`` and write the model card."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from hf_fp8.hub.card import write_model_card
from hf_fp8.hub.card_info import info_from_summary
from hf_fp8.serialization import export_checkpoint
from hf_fp8.serialization.checkpoint import Checkpoint, resolve_checkpoint
from hf_fp8.serialization.summary import summarize


def export(
    model_or_dir: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "compressed-tensors",
    *,
    overwrite: bool = False,
    model_card: bool = True,
) -> Path:
    """Write an hf_fp8 model, checkpoint folder or Hub repo id to ``out_dir`` in ``format``
    (``"compressed-tensors"`` — what vLLM, SGLang, TGI and transformers load — or
    ``"vllm-fp8"``), with a ``README.md`` model card. Only ``out_dir`` is written."""
    base_model = fidelity = None
    if isinstance(model_or_dir, nn.Module):
        state = getattr(model_or_dir, "_hf_fp8_card", None) or {}
        base_model, fidelity = state.get("base_model"), state.get("fidelity")
    else:
        from hf_fp8.hub.card import read_card_info

        readme = resolve_checkpoint(model_or_dir) / "README.md"
        previous = read_card_info(readme.read_text("utf-8")) if readme.is_file() else None
        if previous is not None:
            base_model, fidelity = previous.base_model, previous.fidelity
    out = export_checkpoint(model_or_dir, out_dir, format, overwrite=overwrite)
    if model_card:
        info = info_from_summary(summarize(Checkpoint(out)), base_model=base_model)
        info.fidelity = dict(fidelity or {})
        write_model_card(out, info, model_id=out.name)
    return out
