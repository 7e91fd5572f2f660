"""hf_fp8 checkpoint → compressed-tensors or vLLM ``fp8`` checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from hf_fp8.config import Fp8Config
from hf_fp8.modules import Fp8Linear
from hf_fp8.serialization.checkpoint import (
    CARD_NAME,
    Checkpoint,
    copy_other_files,
    prepare_out_dir,
    resolve_checkpoint,
    rewrite_tensors,
    write_config,
)
from hf_fp8.serialization.formats import format_of, get_format
from hf_fp8.serialization.layers import plan_layers
from hf_fp8.serialization.tensors import check_complete


def hf_fp8_config(checkpoint: Checkpoint) -> Fp8Config:
    """The checkpoint's ``Fp8Config``; raises naming the fix for any other format."""
    fmt = format_of(checkpoint.quantization_config)
    if fmt == "unquantized":
        raise ValueError(
            f"{checkpoint.root} is not quantized: quantize it first "
            "(from_pretrained(..., quantization_config=hf_fp8.Fp8Config(...)) or hf-fp8 quantize)"
        )
    if fmt != "hf_fp8":
        raise ValueError(
            f"{checkpoint.root} is a {fmt} checkpoint, not hf_fp8: import it with "
            "hf_fp8.import_checkpoint (hf-fp8 import) first"
        )
    return Fp8Config.from_dict(checkpoint.quantization_config)


def _save_model(model: nn.Module, out: Path) -> None:
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"export needs a transformers model or a folder, got {type(model).__name__}"
        )
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if not isinstance(qc, Fp8Config) or not any(isinstance(m, Fp8Linear) for m in model.modules()):
        raise ValueError(
            "the model is not an hf_fp8 model: load it with "
            "quantization_config=hf_fp8.Fp8Config(...) first"
        )
    model.save_pretrained(out)
    (out / CARD_NAME).unlink(missing_ok=True)  # it describes the hf_fp8 layout


def export_checkpoint(
    model_or_dir: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "compressed-tensors",
    *,
    overwrite: bool = False,
) -> Path:
    """Write the hf_fp8 model (or checkpoint folder / repo id) ``model_or_dir`` to ``out_dir``
    in ``format`` (``"compressed-tensors"`` or ``"vllm-fp8"``). Tokenizer and other files are
    copied, no model card is written. Returns ``out_dir``."""
    fmt = get_format(format)
    if isinstance(model_or_dir, (str, os.PathLike)):
        src = Checkpoint(resolve_checkpoint(model_or_dir))
        hf_fp8_config(src)
        out = prepare_out_dir(out_dir, source=src.root, overwrite=overwrite)
    else:
        out = prepare_out_dir(out_dir, overwrite=overwrite)
        _save_model(model_or_dir, out)
        src = Checkpoint(out)
    config = hf_fp8_config(src)
    tensors = src.tensors()
    plan = plan_layers(src.config, tensors)
    check_complete(plan, tensors, config)
    quantization_config = fmt.export_config(config, plan)
    rewrite_tensors(src, out, lambda t: fmt.export_tensors(t, plan, config))
    if src.root != out:
        copy_other_files(src, out)
    write_config(out, {**src.config, "quantization_config": quantization_config})
    return out
