"""FP8 checkpoints made by compressed-tensors itself (its schemes, qparams and compressor).

Only the min / max reductions feeding ``calculate_qparams`` are written here; the scale
formula, the fp8 cast and the files come from compressed-tensors.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

from tests.tiny_models import model_inputs

BLOCK = [32, 32]


def _scheme(preset: str) -> QuantizationScheme:
    if preset == "FP8_WEIGHT_ONLY":
        base = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
        return QuantizationScheme(targets=["Linear"], weights=base.weights)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.block_structure is not None:
        scheme.weights.block_structure = list(BLOCK)
    if scheme.input_activations is not None and scheme.input_activations.group_size:
        scheme.input_activations.group_size = BLOCK[1]
    return scheme


def _min_max(w: torch.Tensor, strategy: str, block) -> tuple[torch.Tensor, torch.Tensor]:
    if strategy == "tensor":
        return w.min(), w.max()
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    rows, cols = w.shape
    wb = w.reshape(rows // block[0], block[0], cols // block[1], block[1])
    return wb.amin((1, 3)), wb.amax((1, 3))


@torch.no_grad()
def make_ct_checkpoint(
    base_dir: str, out_dir, preset: str, dtype=torch.float32, ignore=("lm_head",)
) -> None:
    """``preset``: ``FP8_DYNAMIC``, ``FP8`` (static), ``FP8_BLOCK`` or ``FP8_WEIGHT_ONLY``."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    config = QuantizationConfig(config_groups={"group_0": _scheme(preset)}, ignore=list(ignore))
    apply_quantization_config(model, config)
    layers = [m for m in model.modules() if hasattr(m, "weight_scale")]
    observed: dict[int, torch.Tensor] = {}
    hooks = []
    for m in layers:
        m.quantization_enabled = False
        args = m.quantization_scheme.weights
        lo, hi = _min_max(m.weight.float(), args.strategy, args.block_structure)
        scale, _ = calculate_qparams(lo, hi, args)
        m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "input_scale"):

            def observe(mod, inputs):
                amax = inputs[0].abs().amax().float()
                observed[id(mod)] = torch.maximum(observed.get(id(mod), amax), amax)

            hooks.append(m.register_forward_pre_hook(observe))
    if hooks:
        for seed in (1, 2, 3):
            model(**model_inputs("llama", seed=seed))
        for h in hooks:
            h.remove()
        for m in layers:
            amax = observed[id(m)]
            scale, _ = calculate_qparams(-amax, amax, m.quantization_scheme.input_activations)
            m.input_scale.copy_(scale.reshape(m.input_scale.shape))
    for m in layers:
        m.quantization_enabled = True
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
