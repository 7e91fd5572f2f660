"""``Fp8HfQuantizer``: FP8 through ``from_pretrained`` / ``save_pretrained`` (transformers 5.x)."""

from __future__ import annotations

import contextvars
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer

from hf_fp8.config import Fp8Config
from hf_fp8.modules import (
    Fp8Linear,
    check_activation_scales,
    convertible_modules,
    is_conv1d,
    matches_module,
    warn_unmatched,
)
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.origin import dense_layer, mark_source_class, source_class
from hf_fp8.modules.replace import linear_shape, shared_scale
from hf_fp8.modules.selection import task_heads
from hf_fp8.numerics import fp8_dtype, is_fp8, quantize_weight
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.experts import (
    dequantize_experts,
    experts_tensor_names,
    finish_experts,
    is_experts_scale,
    is_experts_weight,
    quantize_experts_tensor,
    swap_experts,
)
from hf_fp8.quantizer.float_layers import (
    layers_to_initialise,
    loaded_shapes,
    quantize_initialised,
    stored_fp8_scales,
    stored_shapes,
)
from hf_fp8.quantizer.input_scales import StoredInputScales, input_scales_metadata
from hf_fp8.quantizer.kept_modules import file_tensor_names, skip_list_hint
from hf_fp8.quantizer.new_layers import heads_stored_fp8, layers_not_stored
from hf_fp8.quantizer.validation import (
    FP8_LINEAR_TENSORS,
    check_bias,
    check_stored_tensor,
    check_weight_scale_shape,
    checkpoint_file,
    experts_weight_features,
    is_bias_dtype,
    stored_dtype,
    validate_loaded_model,
)
from hf_fp8.utils.folders import check_loaded_files, check_loaded_keys, shard_tensor_names

_FP8_PARAMS = ("weight", "weight_scale")
EXPERTS_INPUT_SCALE_SUFFIX = "_input_scale"  # Fp8Experts: ``<proj>_input_scale``

# ``hook(model, hf_quantizer)`` run at the end of every hf_fp8 load. Upper layers add theirs
# (hf_fp8.hub: model cards on save_pretrained / push_to_hub) so this layer imports none of them.
POST_LOAD_HOOKS: list[Callable[[nn.Module, Any], None]] = []

# ``save_pretrained(state_dict=...)``: transformers replaces the state dict passed with what
# ``get_state_dict_and_metadata`` returns. hf_fp8's save_pretrained wrapper (hf_fp8.hub.hooks)
# sets ``(model, state dict, metadata)`` here for the length of that save, once it checked the
# state dict; the metadata's input-scale record then describes that state dict, not the model.
# The first ``get_state_dict_and_metadata`` of that model takes it (and clears it): a save of the
# same model started from within that save writes the model's own tensors (R32 S1).
SAVING: contextvars.ContextVar[tuple[nn.Module, dict, dict] | None] = contextvars.ContextVar(
    "hf_fp8_saving", default=None
)


def _already_fp8(key: str) -> CheckpointTensorError:
    return CheckpointTensorError(
        f"{key}: the checkpoint is already FP8, but it is loading with an on-the-fly "
        "Fp8Config, which would quantize its fp8 codes again and drop their stored scales. "
        "Its config.json lacks the quantization_config it was saved with: restore it (or "
        "re-export the checkpoint with save_pretrained) and load without quantization_config"
    )


def _stored_dtype(param: Any) -> str:
    """The on-disk dtype of a checkpoint tensor: safetensors name (``F8_E4M3``) or torch's."""
    if hasattr(param, "get_dtype"):
        return str(param.get_dtype())
    return str(getattr(param, "dtype", ""))


def _is_fp8_on_disk(param: Any) -> bool:
    stored = _stored_dtype(param)
    return stored.startswith("F8_") or stored in ("torch.float8_e4m3fn", "torch.float8_e5m2")


def default_skipped_modules(model: nn.Module) -> list[str]:
    """What an on-the-fly ``from_pretrained`` load (and ``quantize_model``) keeps in high
    precision besides the config's ``modules_to_not_convert``: transformers' default skips
    (tied weights, the output embeddings, the last module), the model's
    ``_keep_in_fp32_modules`` (T5's ``wo``) and every task head, the linears outside
    ``model.base_model`` (``score``, BERT's ``classifier``, RoBERTa's ``classifier.dense`` /
    ``classifier.out_proj``, ``qa_outputs``: small, and trained with the task, e.g. as peft's
    SEQ_CLS ``modules_to_save``). ``[]`` for a module that is not a transformers
    ``PreTrainedModel``."""
    if not isinstance(model, PreTrainedModel):
        return []
    keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    defaults = HfQuantizer.get_modules_to_not_convert(model, [], keep_fp32, add_default_skips=True)
    return sorted({*defaults, *task_heads(model)})


def _offloaded_dequantize(what: str) -> str:
    return (
        f"cannot dequantize {what}: an offloaded layer keeps its weights in accelerate's "
        "offload store (on disk, or on the CPU), not in the module, and its hooks would read "
        "the fp8 codes there as plain float weights without their scales (silently wrong "
        'outputs). Load the FP8 checkpoint without offloading (no "disk" in device_map) '
        "and dequantize there (Fp8Config(dequantize=True) or model.dequantize()); to offload "
        "the high-precision model, save_pretrained it and load that folder with your device_map"
    )


def _holds_meta_fp8(module: nn.Module) -> bool:
    """An FP8 layer whose fp8 weight is on the meta device (offloaded by accelerate)."""
    if isinstance(module, Fp8Linear):
        return module.weight.is_meta
    if isinstance(module, Fp8Experts):
        return any(getattr(module, p).is_meta for p in module.layout.projections)
    return False


def _weights_train(model: nn.Module) -> bool:
    """Whether the dense weights ``model.dequantize()`` makes should train. The FP8 weights are
    frozen by design, so this is read from the model around them (R30 F1): not where peft
    manages the model (``get_peft_model`` / ``inject_adapter_in_model`` set ``peft_config`` on it
    and froze every base parameter), nor where every other parameter is frozen (after peft's
    ``unload()``, or ``model.requires_grad_(False)``), as on a high-precision model.

    The flag is read from the model's other weight matrices (high-precision ``Linear`` /
    ``Embedding`` / conv weights: ``lm_head``, ``embed_tokens``, a router), not from its biases
    and norms (R32 F4: BitFit and norm tuning made every dense weight trainable, where the
    float model with the same freezing keeps its linears frozen): all of them train (a full
    fine-tune, as after a float load) -> the dense weights train; any of them frozen -> frozen
    (BitFit, norms only, a head-only probe, all frozen). A partly frozen model whose dense
    weights are so kept frozen while something else trains warns, naming how to train them
    (its frozen matrices may also be the embeddings only, which the flags cannot tell)."""
    if hasattr(model, "peft_config"):
        return False
    peft = sys.modules.get("peft.tuners.tuners_utils")
    tuner = getattr(peft, "BaseTunerLayer", None)
    if tuner is not None and any(isinstance(m, tuner) for m in model.modules()):
        return False
    fp8_frozen: set[int] = set()
    dense: list[str] = []  # the dense weights dequantize makes
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, Fp8Linear):
            fp8_frozen.update(map(id, (module.weight, module.weight_scale, module.input_scale)))
            dense.append(f"{prefix}weight")
        elif isinstance(module, Fp8Experts):
            fp8_frozen.update(map(id, module._frozen()))
            dense += [f"{prefix}{proj}" for proj in module.layout.projections]
    others = [(n, p) for n, p in model.named_parameters() if id(p) not in fp8_frozen]
    matrices = [(n, p) for n, p in others if p.dim() >= 2] or others
    if all(p.requires_grad for _, p in matrices):
        return True  # a full fine-tune (or nothing else to read: as after a float load)
    trained = [n for n, p in others if p.requires_grad]
    if trained and dense:
        frozen = [n for n, p in matrices if not p.requires_grad]
        warnings.warn(
            f"hf_fp8: dequantize(): the model is partly frozen ({_names(trained)} train; "
            f"its other weight matrices {_names(frozen)} do not), so the {len(dense)} dense "
            f"weight(s) made from its FP8 layers ({_names(dense)}) are frozen too, as a float "
            "model's linears under BitFit, norm or head tuning (FP8 weights have no trainable "
            "flag of their own). To train them (e.g. you froze only the embeddings), call "
            "requires_grad_(True) on these weights after dequantize()",
            UserWarning,
            stacklevel=5,  # _dequantize, HfQuantizer.dequantize, model.dequantize, the caller
        )
    return False


def _names(names: list[str]) -> str:
    return f"{len(names)}: " + ", ".join(names[:3]) + (", …" if len(names) > 3 else "")


def _dequantize_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The compute dtype ``model.dequantize`` was given: transformers passes
    ``config.dtype``, which is the string ``"float32"`` after ``save_pretrained``."""
    if dtype is None or dtype == "auto":
        return None
    resolved = dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
    if isinstance(resolved, torch.dtype) and is_bias_dtype(resolved):
        return resolved
    raise ValueError(
        f"dequantize: dtype {dtype!r} is not a high-precision float dtype; pass "
        "torch.bfloat16, torch.float16 or torch.float32 (or their names)"
    )


def _is_input_scale(name: str) -> bool:
    """``name`` is a static activation scale: an ``Fp8Linear``'s ``<module>.input_scale`` or an
    ``Fp8Experts`` projection's ``<module>.<proj>_input_scale``."""
    leaf = name.rpartition(".")[2]
    return leaf == "input_scale" or leaf.endswith(EXPERTS_INPUT_SCALE_SUFFIX)


def _refuse_stored_input_scales(names: set[str], scheme: str, root: str) -> None:
    """A pre-quantized load whose config says ``scheme`` ("dynamic", "weight_only")
    activations, of a checkpoint storing static input scales (``names``: its tensor names):
    the loader would drop them as unexpected keys and the layers would run without their
    calibrated scales (reviewer R22 F2). ``hf-fp8 inspect`` / ``export`` refuse it too.
    ``Fp8Config(dequantize=True)`` loads are not refused: a dequantized layer has no
    activation quantization."""
    stored = sorted(n for n in names if _is_input_scale(n))
    if not stored:
        return
    shown = ", ".join(stored[:4]) + (" …" if len(stored) > 4 else "")
    config_json = os.path.join(root, "config.json") if root else "its config.json"
    raise CheckpointTensorError(
        f"{stored[0]}: the checkpoint {checkpoint_file(root, stored[0])} stores "
        f"{len(stored)} static activation scale(s) ({shown}), but its quantization_config "
        f"says {scheme!r} activations: from_pretrained would drop them and the layers would "
        "run without their calibrated scales. If the checkpoint was calibrated, set "
        '"activation_scheme": "static" (with "activation_granularity": "tensor") in the '
        f"quantization_config of {config_json}; to run {scheme!r}, remove the input_scale "
        "tensors from the checkpoint. Fp8Config(dequantize=True) loads it in high precision "
        "as it is"
    )


def _loading_kernel(config: Fp8Config, stored: str | None) -> Fp8Config:
    """R39 F5: the kernel of a pre-quantized load. hf_fp8 saves ``"kernel": "auto"``; an older
    checkpoint's stored ``"scaled_mm"`` (``stored``) is a preference: where no device of this
    machine runs ``torch._scaled_mm`` it falls back to ``"auto"`` with a warning. One passed
    at load (``stored`` is ``None``) that cannot run here is refused, naming the fix."""
    from hf_fp8.kernels.capability import has_fp8_gemm

    if config.kernel != "scaled_mm" or config.dequantize or has_fp8_gemm():
        return config
    why = "torch._scaled_mm needs a CUDA GPU with compute capability >= 8.9 (not ROCm)"
    if stored is None:
        raise ValueError(
            f"kernel='scaled_mm' was passed to from_pretrained, but it cannot run here: {why}. "
            "Load the checkpoint with from_pretrained(..., quantization_config="
            "Fp8Config(kernel='auto')) to run the FP8 emulation where torch._scaled_mm cannot "
            "run (or kernel='emulated'); a loaded layer's kernel can also be set later "
            "(layer.kernel = 'scaled_mm') on a machine that has one"
        )
    warnings.warn(
        "hf_fp8: the checkpoint's config.json asks kernel='scaled_mm' (saved by an older "
        f"hf_fp8), which cannot run here: {why}. Loading with kernel='auto' (the FP8 "
        "emulation here); a saved checkpoint records no kernel choice now (save_pretrained "
        "writes 'auto')",
        UserWarning,
        stacklevel=4,
    )
    return config.replace(kernel="auto")


def _warn_passed_scales(passed: dict, filled: list[str], kept: list[str]) -> None:
    """R39 F3: what the static scales passed to ``from_pretrained`` for a pre-quantized
    checkpoint did: they fill the layers without a stored ``input_scale`` only."""
    given = " / ".join(k for k, v in passed.items() if v is not None)
    text = (
        f"hf_fp8: Fp8Config({given}=...) passed to from_pretrained filled the input scales of "
        f"{len(filled)} layer(s) the checkpoint does not store ({_names(filled)}); "
        if filled
        else f"hf_fp8: Fp8Config({given}=...) passed to from_pretrained filled no input scale; "
    )
    if kept:
        text += (
            f"the {len(kept)} layer(s) whose input_scale the checkpoint stores ({_names(kept)}) "
            "keep it: a passed config does not override a saved checkpoint. "
        )
    text += (
        "To change stored scales, calibrate the loaded model (hf_fp8.calibrate(model, "
        "batches)) or set one with model.get_submodule(name).set_input_scale(x)"
    )
    warnings.warn(text, UserWarning, stacklevel=4)


def _refuse_parallel_plans(config: Any) -> None:
    """R39 F2: tensor (``tp_plan`` / ``tp_size``) and expert (``ep_size``) parallelism of an
    FP8 model are refused: transformers would shard a layer's fp8 weight but not its scales
    with it (a row-wise ``[out, 1]`` scale split on dim 1, a tensor-wise one size-mismatched),
    and dynamic activation scales taken over a shard of the input differ from the whole
    model's. Raised alike on every rank, before any weight is read."""
    distributed = getattr(config, "distributed_config", None)
    if distributed is None:
        return
    if isinstance(distributed, dict):
        sizes = {k: distributed.get(k) for k in ("tp_size", "ep_size")}
    else:
        sizes = {k: getattr(distributed, k, None) for k in ("tp_size", "ep_size")}
    used = {k: v for k, v in sizes.items() if isinstance(v, int) and v > 1}
    if not used:
        return
    shown = ", ".join(f"{k}={v}" for k, v in used.items())
    raise ValueError(
        f"hf_fp8: tensor parallel / expert parallel loading ({shown}: tp_plan=..., "
        "DistributedConfig) is not supported for FP8 models: transformers shards the fp8 "
        "weights but not their scales, and dynamic activation scales taken over a shard of the "
        "input differ from the whole model's. Load without tp_plan / distributed_config: on "
        'one process, device_map="auto" (or a device) spreads the layers over the devices; '
        "to train over several ranks, shard the loaded FP8 model with FSDP2 (fully_shard, or "
        "accelerate with fsdp_version: 2); or load the high-precision checkpoint with tp_plan"
    )


def _experts_not_stored(names: list[str], detail: str) -> ValueError:
    """R42 F4: MoE experts the high-precision checkpoint lacks or stores at another size."""
    shown = ", ".join(names[:3]) + (" …" if len(names) > 3 else "")
    listed = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return ValueError(
        f"{shown}: MoE experts the high-precision checkpoint {detail}. Experts missing from a "
        "float checkpoint (or stored at another size) are not supported on the fly: hf_fp8 "
        "quantizes experts while loading and has no stored weights to quantize. Keep them in "
        f"high precision with Fp8Config(modules_to_not_convert=[{listed}]) (transformers "
        "initialises them as in the float model), or load without quantization_config and "
        "call hf_fp8.quantize_model on the model"
    )


def _refuse_experts_not_stored(experts: dict, stored: dict | None) -> None:
    """On the fly: the experts whose projections the float checkpoint (``stored``: loaded
    name -> shape, from its headers) does not store at all are refused before loading, named
    (R42 F4). Nothing is refused when no experts tensor is found under the loader's names
    (a renaming not followed here: the checks after loading decide)."""
    if stored is None or not experts:
        return
    wanted = {
        name: [f"{name}.{proj}" for proj in module.layout.projections]
        for name, module in experts.items()
    }
    if not any(key in stored for keys in wanted.values() for key in keys):
        return
    lacking = [name for name, keys in wanted.items() if not all(k in stored for k in keys)]
    if lacking:
        raise _experts_not_stored(
            lacking, "does not store (a config with more layers than the checkpoint)"
        )


def _experts_shape_error(
    key: str, weight: torch.Tensor, module: Fp8Experts, proj: str
) -> ValueError | None:
    """The error naming the experts when the merged high-precision ``weight`` of the projection
    ``proj`` of ``module`` does not have the module's shape (source layout) (R42 F4)."""
    codes = getattr(module, proj, None)
    if codes is None:
        return None
    expected = tuple(codes.shape)
    if module.layout.is_transposed:
        expected = (expected[0], expected[2], expected[1])
    if tuple(weight.shape) == expected:
        return None
    return _experts_not_stored(
        [key.rpartition(".")[0]],
        f"stores at another size ({key}: {list(weight.shape)}, the model's "
        f"{list(expected)}; ignore_mismatched_sizes=True)",
    )


def _is_fp8_scale(module: nn.Module, tensor_name: str) -> bool:
    """``tensor_name`` is a scale of the FP8 layer ``module`` (which a float checkpoint never
    stores)."""
    if isinstance(module, Fp8Linear) and tensor_name in ("weight_scale", "input_scale"):
        return True
    return is_experts_scale(module, tensor_name)


class Fp8QuantizeOp(ConversionOps):
    """Loader op: one high-precision checkpoint weight → ``weight`` (fp8) + ``weight_scale``."""

    def __init__(self, hf_quantizer: Fp8HfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], *args, model=None, **kwargs) -> dict[str, Any]:
        out = {}
        for key, value in input_dict.items():
            weight = value[0] if isinstance(value, list) else value
            if is_fp8(weight.dtype):
                raise _already_fp8(key)
            module_name, _, tensor_name = key.rpartition(".")
            module = model.get_submodule(module_name)
            if isinstance(module, Fp8Experts):  # the merged [E, ...] tensor of one projection
                wrong = _experts_shape_error(key, weight, module, tensor_name)
                if wrong is not None:
                    # transformers would log a raised error as a CONVERSION entry and raise a
                    # RuntimeError naming none: the quantizer raises it after loading
                    self.hf_quantizer.op_errors.append(wrong)
                    continue
                out.update(quantize_experts_tensor(key, weight, module))
                continue
            if not isinstance(module, Fp8Linear):
                # a layer kept plain while loading (quantized after it), reached by a converter
                # that splits one stored tensor into it and FP8 layers (HRM's gqkv_proj)
                target = getattr(module, tensor_name, None)
                if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
                    weight = weight.to(target.dtype)
                out[key] = weight
                continue
            if module_name in self.hf_quantizer.transposed_modules:
                weight = weight.t()  # GPT-2 Conv1D stores [in, out]
            expected = (module.out_features, module.in_features)
            if tuple(weight.shape) != expected:  # a checkpoint whose shapes were not read
                raise CheckpointTensorError(
                    f"{key}: the checkpoint stores it as {list(weight.shape)}, but the model's "
                    f"layer is {list(expected)} (a resized layer): hf_fp8 reads the shapes of "
                    ".safetensors checkpoints only, to let transformers initialise such a layer "
                    "(ignore_mismatched_sizes=True) before quantizing it. Save the checkpoint as "
                    "safetensors (save_pretrained), or load it without quantization_config and "
                    "call hf_fp8.quantize_model on the model"
                )
            w_fp8, w_scale = quantize_weight(
                weight,
                fp8_dtype(module.fp8_format),
                module.weight_granularity,
                module.block_size,
                name=key,
                scale_method=self.hf_quantizer.quantization_config.weight_scale_method,
            )
            out[key] = w_fp8.contiguous()
            out[f"{module_name}.weight_scale"] = w_scale
            self.hf_quantizer.produced_keys.add(f"{module_name}.weight_scale")
        return out


class Fp8HfQuantizer(HfQuantizer):
    """Swaps ``nn.Linear`` (and GPT-2 ``Conv1D``) for ``Fp8Linear`` while a model loads."""

    requires_calibration = False
    quantization_config: Fp8Config

    def __init__(self, quantization_config: Fp8Config, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self.transposed_modules: set[str] = set()
        self.modules_to_not_convert: list[str] = []
        # checkpoint keys of every Fp8Linear tensor: read in their stored dtype, then checked
        self.fp8_tensor_names: set[str] = set()
        # on-the-fly loads: scales found in the checkpoint (it is FP8 already: refused)
        self.stored_scale_keys: set[str] = set()
        # on-the-fly loads: the checkpoint's {loaded name: shape} (None: not readable), the
        # scales the quantize op made, and the layers transformers initialises (R39 F1, F4)
        self.float_shapes: dict[str, tuple[int, ...]] | None = None
        self.produced_keys: set[str] = set()
        self.op_errors: list[ValueError] = []  # found by the quantize op (R42 F4)
        self.initialised_layers: list[str] = []
        # checkpoint keys of every Fp8Experts tensor: kept in their stored dtype, checked after
        self.experts_tensor_names: set[str] = set()
        # checkpoint keys of the biases of FP8 layers: refused as fp8 / integers while loading
        self.bias_names: set[str] = set()
        # checkpoint key of each weight scale -> (out, in) of its Fp8Linear weight, or
        # (E, out, in) of its Fp8Experts projection
        self.weight_features: dict[str, tuple[int, ...]] = {}
        self.checkpoint_root = ""  # the folder read (root/subfolder): errors name files in it
        self.checkpoint_files: list[str] = []  # what transformers resolved and reads
        self.stored_names: set[str] | None = None  # their tensor names (pre-quantized loads)
        # static scales passed to from_pretrained for a pre-quantized checkpoint (R39 F3)
        self.fill_scales = quantization_config.fill_scales if self.pre_quantized else None
        # pre-quantized: the kernel read from config.json (None: one was passed at load)
        self.stored_kernel = (
            quantization_config.kernel
            if self.pre_quantized and not quantization_config.kernel_assigned
            else None
        )

    @property
    def quantized_element_size(self) -> float:
        return 1

    def validate_environment(self, *args, device_map=None, **kwargs) -> None:
        if not self.pre_quantized and self.quantization_config.dequantize:
            raise ValueError(
                "Fp8Config(dequantize=True) loads an FP8 checkpoint back in high precision, "
                "but this checkpoint's config.json has no quantization_config, so it would be "
                "quantized on the fly: the flag would be ignored and an FP8 model returned. If "
                "the folder holds hf_fp8 FP8 weights (its config.json lost the "
                "quantization_config save_pretrained wrote), restore that quantization_config "
                "and pass Fp8Config(dequantize=True) again. A high-precision checkpoint: call "
                "from_pretrained without quantization_config to load it as it is, or leave "
                "dequantize=False to quantize it"
            )
        # a layer offloaded to disk never reaches its module: its scales are read and checked
        # while loading (get_new_dtype); otherwise only after loading, where all are in memory
        to_disk = isinstance(device_map, dict) and "disk" in set(map(str, device_map.values()))
        self.may_offload_to_disk = to_disk or device_map in (
            "auto",
            "balanced",
            "balanced_low_0",
            "sequential",
        )
        if to_disk and not self.pre_quantized:
            raise ValueError(
                "on-the-fly FP8 quantization cannot offload to disk; quantize and save first "
                "(model.save_pretrained), then load the FP8 checkpoint with this device_map"
            )
        if to_disk and self.quantization_config.dequantize:
            raise ValueError(_offloaded_dequantize('the layers device_map sends to "disk"'))
        if not torch.cuda.is_available():
            # CPU inference: build (or load) the C kernel from the start of the load (the
            # first call transformers makes), so that the first forward does not pay for it
            from hf_fp8.kernels.cpu_kernel import prebuild

            prebuild()

    def update_attn_implementation(self, config):
        # transformers' first call with the model config (after validate_environment, before
        # any file is read): a DistributedConfig asking for tensor / expert parallelism is
        # refused here, alike on every rank
        _refuse_parallel_plans(config)
        return super().update_attn_implementation(config)

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return dtype
        if not self.pre_quantized:
            raise ValueError(
                "dtype is the compute dtype of an FP8 model (bfloat16, float16 or float32), not fp8"
            )
        # hf_fp8 before R21 saved models whose first parameter is an FP8 weight with
        # "dtype": "float8_e4m3fn" in config.json (transformers' model.dtype). float32 holds
        # every stored high-precision tensor (bf16 / fp16 / fp32) exactly.
        name = str(dtype).removeprefix("torch.")
        warnings.warn(
            f"hf_fp8: dtype {name} (config.json of a checkpoint saved by an older hf_fp8, or the "
            "dtype argument) is not a compute dtype: loading in float32; pass "
            "from_pretrained(..., dtype=torch.bfloat16) to choose, save_pretrained again to "
            "repair config.json",
            UserWarning,
            stacklevel=2,
        )
        return torch.float32

    # -- before loading: swap modules on the meta device ---------------------------------------
    def _process_model_before_weight_loading(self, model, keep_in_fp32_modules=None, **kwargs):
        _refuse_parallel_plans(getattr(model, "config", None))  # before any rank shards
        if self.pre_quantized:
            self.quantization_config = _loading_kernel(self.quantization_config, self.stored_kernel)
        config = self.quantization_config
        saved_skips = config.modules_to_not_convert is not None
        if self.pre_quantized and saved_skips:
            skip = list(config.modules_to_not_convert)  # what the saved model actually kept
        else:
            warn_unmatched(model, config.modules_to_not_convert or [], "modules_to_not_convert")
            skip = list({*(config.modules_to_not_convert or []), *default_skipped_modules(model)})
            config = config.replace(modules_to_not_convert=sorted(skip))  # configs are frozen
            self.quantization_config = config
        self.modules_to_not_convert = skip
        self.checkpoint_root = str(getattr(model.config, "_name_or_path", "") or "")
        self.checkpoint_files = [os.fspath(f) for f in kwargs.get("checkpoint_files") or ()]
        if self.pre_quantized and os.path.isdir(self.checkpoint_root):
            # transformers follows ``..`` / absolute shard names and symlinks: the index it
            # reads and the files it names must be the folder's own (DESIGN §8). The folder
            # read is ``root/subfolder``: errors name files there.
            self.checkpoint_root = check_loaded_files(self.checkpoint_root, self.checkpoint_files)
        elif self.pre_quantized:  # a Hub id: the shards in the cache, each tensor stored once
            check_loaded_keys(self.checkpoint_files)
        if self.pre_quantized:
            self.stored_names = file_tensor_names(self.checkpoint_files)
            if config.activation_scheme != "static" and not config.dequantize:
                _refuse_stored_input_scales(
                    self._header_names(), config.activation_scheme, self.checkpoint_root
                )
            if not saved_skips:  # a hand-written config: the default skips, but a task head
                stored_fp8 = heads_stored_fp8(model, self.stored_names)  # stored FP8 is FP8
                skip = sorted(set(skip) - set(stored_fp8))
                config = config.replace(modules_to_not_convert=skip)
                self.quantization_config = config
                self.modules_to_not_convert = skip
            new_layers = layers_not_stored(model, self.stored_names, skip)
            if new_layers:  # a new task head: high precision, initialised by transformers
                skip = sorted({*skip, *new_layers})
                config = config.replace(modules_to_not_convert=skip)
                self.quantization_config = config
        if not self.pre_quantized:  # layers the float checkpoint lacks / stores resized
            self.float_shapes = loaded_shapes(model, stored_shapes(self.checkpoint_files))
            self.initialised_layers = layers_to_initialise(model, self.float_shapes, skip)
            skip = sorted({*skip, *self.initialised_layers})  # plain while loading
        static_pre_quantized = self.pre_quantized and config.activation_scheme == "static"
        swapped: dict[int, Fp8Linear] = {}  # a linear shared by two parents stays shared
        aliases: dict[int, list[str]] = {}  # its names: one scale under any of them (R27 F3)
        for name, module, parent in convertible_modules(model, skip=skip):
            new = swapped.get(id(module))
            if new is not None:
                names = aliases.setdefault(id(module), [new.__dict__["fp8_name"]])
                names.append(name)
                new._hf_fp8_input_scale = shared_scale(config, names)
                setattr(parent, name.rpartition(".")[2], new)
                continue
            in_features, out_features = linear_shape(module)
            if is_conv1d(module) and not self.pre_quantized:
                self.transposed_modules.add(name)
            # device="meta" rather than a `torch.device("meta")` block: the loader's meta
            # context is already active, and a nested one adds a second Python mode to every
            # tensor op (this loop runs once per linear layer of every load).
            new = Fp8Linear(
                in_features,
                out_features,
                module.bias is not None,
                device="meta",
                dtype=module.weight.dtype,
                recipe=config.recipe,
            )
            swapped[id(module)] = new
            new.__dict__["fp8_name"] = name  # named in warnings
            mark_source_class(new, module)  # a Conv1D dequantizes to a Conv1D (R31)
            if static_pre_quantized:
                new.input_scale = nn.Parameter(
                    torch.empty(1, dtype=torch.float32, device="meta"), requires_grad=False
                )
            # applied after loading (on-the-fly; pre-quantized: where none is stored)
            new._hf_fp8_input_scale = self._given_scale(config, name)
            new._is_hf_initialized = (
                True  # never random-init fp8 storage; missing keys are caught below
            )
            setattr(parent, name.rpartition(".")[2], new)
            self.fp8_tensor_names.update(f"{name}.{t}" for t in FP8_LINEAR_TENSORS)
            self.weight_features[f"{name}.weight_scale"] = (out_features, in_features)
            if module.bias is not None:
                self.bias_names.add(f"{name}.bias")
        all_experts = swap_experts(model, config, skip=skip, pre_quantized=self.pre_quantized)
        if not self.pre_quantized:
            _refuse_experts_not_stored(all_experts, self.float_shapes)
        for name, experts in all_experts.items():
            self.experts_tensor_names.update(experts_tensor_names(name, experts))
            self.weight_features.update(experts_weight_features(name, experts))
            self.bias_names.update(
                f"{name}.{proj}_bias"
                for proj in experts.layout.projections
                if getattr(experts, f"{proj}_bias", None) is not None
            )
        if not self.pre_quantized:  # a key that names no converted layer: refused, named
            later = set(self.initialised_layers)  # quantized after loading
            converted = [
                (n, m)
                for n, m in model.named_modules(remove_duplicate=False)
                if isinstance(m, (Fp8Linear, Fp8Experts)) or n in later
            ]
            check_activation_scales(model, config.activation_scales, converted)
            stored_scales = stored_fp8_scales(model, self.float_shapes, _is_fp8_scale)
            if stored_scales:  # the checkpoint is FP8 already
                raise _already_fp8(stored_scales[0])
        if self.pre_quantized and self.fill_scales:  # R42 F3: refused as on the fly
            check_activation_scales(model, self.fill_scales.get("activation_scales"))
        model.config.quantization_config = config

    def _given_scale(self, config: Fp8Config, name: str) -> float | None:
        """The static input scale given for the layer ``name``: the scales passed to
        ``from_pretrained`` for a pre-quantized checkpoint (``fill_scales``), else the
        config's own."""
        passed = self.fill_scales or {}
        scale = (passed.get("activation_scales") or {}).get(name, passed.get("activation_scale"))
        return scale if scale is not None else config.activation_scale_for(name)

    def _header_names(self) -> set[str]:
        """The tensor names of the checkpoint files read: ``stored_names``, else (a ``.bin``
        among them) what the capped header readers can read of each file."""
        if self.stored_names is not None:
            return self.stored_names
        names: set[str] = set()
        for file in self.checkpoint_files:
            names.update(shard_tensor_names(file) or ())
        return names

    def update_parallel_plan(self, model, plan: dict[str, str]) -> None:
        # The base class walks every parameter name to add tensor-parallel entries for the
        # `serialized_names` companions; hf_fp8 declares none (its tensors keep the module's
        # names), so that walk would add nothing.
        if getattr(self, "serialized_names", None):
            super().update_parallel_plan(model, plan)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module_name, _, tensor_name = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        kept_plain = (
            tensor_name in ("weight_scale", "input_scale")
            and module_name in self.initialised_layers
        )
        if param_name not in self.produced_keys and (  # asked again for the op's outputs
            kept_plain or _is_fp8_scale(module, tensor_name)
        ):
            # the loader asks for every checkpoint key: a stored scale means the file is FP8
            # already (refused after loading, when the keys are all known); also when the
            # file headers were read: their names may follow a renaming not seen there
            # (R42 F1: a base-model prefix, a key_mapping)
            self.stored_scale_keys.add(param_name)
        return (isinstance(module, Fp8Linear) and tensor_name == "weight") or is_experts_weight(
            module, tensor_name
        )

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        """Bytes per element for device-map planning (without ``param_needs_quantization``,
        which records checkpoint keys)."""
        if self.pre_quantized:
            return param.element_size()
        module_name, _, tensor_name = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        quantized = (
            isinstance(module, Fp8Linear) and tensor_name == "weight"
        ) or is_experts_weight(module, tensor_name)
        return self.quantized_element_size if quantized else param.element_size()

    def get_new_dtype(self, converter, param, dtype: torch.dtype | None) -> torch.dtype | None:
        """Pre-quantized loads: fp8 bytes and Fp8Linear tensors arrive in their stored dtype.

        The loader would cast them to the meta dtype: an e5m2 weight into e4m3, a float32
        weight into fp8 codes, an fp16 scale into fp32, fp8 codes into an ``nn.Linear``.
        Uncast, each is caught by the checks after loading, with its name.
        """
        targets = [t for t in getattr(converter, "target_patterns", None) or () if t]
        for key in targets:
            if key in self.bias_names:  # fp8 bytes are kept as stored (below): refuse them
                self._check_bias(key, stored_dtype(key, param))
            features = self.weight_features.get(key)  # Fp8Linear and Fp8Experts weight scales
            shape = (
                param.get_shape() if hasattr(param, "get_shape") else getattr(param, "shape", None)
            )
            if features is not None and shape is not None:  # before anything is read
                check_weight_scale_shape(
                    key,
                    tuple(shape),
                    features,
                    self.quantization_config.recipe,
                    root=self.checkpoint_root,
                    files=self.checkpoint_files,
                )
        ours = [t for t in targets if t in self.fp8_tensor_names]
        for key in ours:  # before anything is read or offloaded to disk
            try:
                check_stored_tensor(
                    key,
                    param,
                    fp8_dtype=fp8_dtype(self.quantization_config.fp8_format),
                    read_scales=getattr(self, "may_offload_to_disk", True),
                )
            except CheckpointTensorError as err:
                hint = self._skip_list_hint(key, param)
                if hint is None:
                    raise
                raise CheckpointTensorError(hint) from err
        if ours or _is_fp8_on_disk(param) or any(t in self.experts_tensor_names for t in targets):
            return None  # Fp8Experts tensors: checked after loading (check_fp8_experts)
        return super().get_new_dtype(converter, param, dtype)

    def _check_bias(self, key: str, dtype: torch.dtype) -> None:
        """``check_bias``; the file named (an index parse) only when it fails."""
        if not is_bias_dtype(dtype):
            check_bias(key, dtype, source=checkpoint_file(self.checkpoint_root, key))

    def _skip_list_hint(self, key: str, param: Any) -> str | None:
        """A high-precision weight where FP8 codes were expected, in a pre-quantized load:
        the config's ``modules_to_not_convert`` lost a layer the checkpoint kept?"""
        if not (self.pre_quantized and key.endswith(".weight")):
            return None
        try:
            dtype = stored_dtype(key, param)
        except CheckpointTensorError:
            return None
        if not dtype.is_floating_point or is_fp8(dtype):
            return None
        return skip_list_hint(
            key, self.checkpoint_root, self.modules_to_not_convert, self.checkpoint_files
        )

    def get_quantize_ops(self) -> Fp8QuantizeOp:
        return Fp8QuantizeOp(self)

    # -- after loading ----------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs):
        if torch.is_inference_mode_enabled():
            _normal_parameters(model)
        if self.stored_scale_keys:
            raise _already_fp8(min(self.stored_scale_keys))
        if self.op_errors:  # transformers would raise a RuntimeError naming none
            raise self.op_errors[0]
        if self.initialised_layers:  # initialised by transformers as in the float model
            quantize_initialised(model, self.initialised_layers, self.quantization_config)
        missing = []
        static = self.pre_quantized and self.quantization_config.activation_scheme == "static"
        input_scales = StoredInputScales(
            self.stored_names if static else None, files=self.checkpoint_files
        )
        disk = [k for k, v in (getattr(model, "hf_device_map", None) or {}).items() if v == "disk"]
        filled: list[str] = []  # layers given a passed scale (not stored)
        kept: list[str] = []  # layers whose stored scale a passed one did not override
        for name, module in model.named_modules():
            if isinstance(module, Fp8Experts):
                last = getattr(module, module.layout.projections[-1])
                offloaded = last.is_meta and ("" in disk or matches_module(name, disk))
                for proj in module.layout.projections:
                    key = f"{proj}_input_scale"
                    input_scales.add(f"{name}.{key}", getattr(module, key), offloaded=offloaded)
                missing += finish_experts(
                    name,
                    module,
                    self.quantization_config,
                    offloaded=offloaded,
                    checkpoint_root=self.checkpoint_root,
                    scale_for=lambda n: self._given_scale(self.quantization_config, n),
                    filled=filled,
                    kept=kept,
                )
                continue
            if not isinstance(module, Fp8Linear):
                continue
            # disk-offloaded tensors stay on meta: accelerate's hooks read them at forward time
            offloaded = module.weight.is_meta and ("" in disk or matches_module(name, disk))
            for pname in (*_FP8_PARAMS, "bias"):
                p = getattr(module, pname)
                if p is not None and not (offloaded or getattr(p, "_is_hf_initialized", False)):
                    missing.append(f"{name}.{pname}")
            scale = module.input_scale
            input_scales.add(f"{name}.input_scale", scale, offloaded=offloaded)
            if scale is not None and not (offloaded or getattr(scale, "_is_hf_initialized", False)):
                module.input_scale = None  # saved before calibration (or refused below)
            given = module.__dict__.pop("_hf_fp8_input_scale", None)
            if given is not None and module.input_scale is None:
                module.set_input_scale(given)
                filled.append(name)
            elif given is not None and not offloaded:
                kept.append(name)
            for p in (module.weight, module.weight_scale, module.input_scale):
                if p is not None:
                    p.requires_grad_(False)
            if module.bias is not None:  # never an fp8 compute dtype
                self._check_bias(f"{name}.bias", module.bias.dtype)
                module.compute_dtype = module.bias.dtype
        if missing and not self.pre_quantized:  # on the fly: the files' shapes were not read
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            raise ValueError(
                f"the high-precision checkpoint lacks {len(missing)} tensor(s) the model needs: "
                f"{shown}. transformers initialises such layers in a float model; hf_fp8 does "
                "too (then quantizes them) when it can read the checkpoint's tensor names and "
                "shapes, which it reads from .safetensors files only. Save the checkpoint as "
                "safetensors (save_pretrained), list these modules in "
                "Fp8Config(modules_to_not_convert=[...]) to keep them in high precision, or load "
                "without quantization_config and call hf_fp8.quantize_model on the model"
            )
        if missing:
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            raise ValueError(
                f"the FP8 checkpoint lacks {len(missing)} tensor(s) its modules need: {shown}. "
                "Re-export it with hf_fp8 (save_pretrained), or list these modules in "
                "Fp8Config(modules_to_not_convert=[...]) when quantizing on the fly."
            )
        if self.fill_scales:
            _warn_passed_scales(self.fill_scales, filled, kept)
        input_scales.check(self.checkpoint_root, self.quantization_config)
        input_scales.check_shared(model)  # one module, two names: one stored scale
        validate_loaded_model(model, skipped=self.modules_to_not_convert)
        if self.pre_quantized and self.quantization_config.dequantize:
            self._dequantize(model)  # Fp8Config(dequantize=True): back to high precision
        saved = getattr(model.config, "quantization_config", None)
        if saved is self.quantization_config and saved.kernel != "auto":
            # the layers keep the kernel chosen at load; a checkpoint records none (R39 F5)
            model.config.quantization_config = saved.replace(kernel="auto")
        for hook in POST_LOAD_HOOKS:
            hook(model, self)
        return model

    # -- dequantize / flags ------------------------------------------------------------------------
    def _dequantize(self, model, dtype=None):
        dtype = _dequantize_dtype(dtype)
        offloaded = [n for n, m in model.named_modules() if _holds_meta_fp8(m)]
        if offloaded:  # refused before any layer is swapped
            shown = ", ".join(offloaded[:3]) + (" …" if len(offloaded) > 3 else "")
            raise ValueError(
                _offloaded_dequantize(f"{len(offloaded)} offloaded FP8 layer(s) ({shown})")
            )
        weights_train = _weights_train(model)  # biases keep their own flags
        for module in list(model.modules()):
            hook = getattr(module, "_hf_fp8_dequantize", None)
            if callable(hook):  # hf_fp8.lora: a merged adapter's dense base becomes the base
                hook(dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, Fp8Linear):
                parent_name, _, child = name.rpartition(".")
                linear = module.dequantize()
                if dtype is not None:
                    linear = linear.to(dtype)
                dense = dense_layer(  # GPT-2's Conv1D where the layer replaced one (R31)
                    linear.weight.detach(),
                    None if linear.bias is None else linear.bias.detach(),
                    source_class(module),
                    weight_grad=weights_train,
                    bias_grad=module.bias is not None and module.bias.requires_grad,
                )
                setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
        experts = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Experts)}
        dequantize_experts(model, dtype)
        for name, old in experts.items():
            new = model.get_submodule(name)
            for proj in old.layout.projections:
                getattr(new, proj).requires_grad_(weights_train)
                bias, new_bias = (
                    getattr(old, f"{proj}_bias", None),
                    getattr(new, f"{proj}_bias", None),
                )
                if bias is not None and isinstance(new_bias, nn.Parameter):
                    new_bias.requires_grad_(bias.requires_grad)
        return model

    def is_serializable(self, **kwargs) -> bool:
        return True

    def get_state_dict_and_metadata(self, model):
        """``save_pretrained``: the state dict passed to it (``state_dict=``, handed over in
        :data:`SAVING`), else the model's own (None); every shard's metadata records which
        static input scales it saves (``hf_fp8.quantizer.input_scales``), so a model with
        scales set on some layers only reloads as saved, while a checkpoint that lost scales
        after saving is still refused."""
        saving = SAVING.get()
        if saving is not None and saving[0] is model:
            SAVING.set(None)  # handed to this save only, not to one it starts (R32 S1)
            return saving[1], dict(saving[2])
        return None, input_scales_metadata(model)

    @property
    def is_trainable(self) -> bool:
        return True  # PEFT adapters on top of frozen FP8 weights

    @property
    def is_qat_trainable(self) -> bool:
        return False  # FP8 weights are frozen; full fine-tuning needs high precision

    @property
    def is_compileable(self) -> bool:
        return True


def _normal_parameters(model: nn.Module) -> None:
    """Under ``torch.inference_mode()`` transformers' loader hands a quantized model's tensors
    over as inference tensors (a float model's stay normal): then a forward in grad mode
    raises "Inference tensors cannot be saved for backward" and a later ``load_state_dict``
    or ``calibrate`` cannot update them (R31 F11). Each parameter becomes a normal tensor
    (one copy; tied parameters stay tied); buffers stay as the float load leaves them."""
    made: dict[int, nn.Parameter] = {}
    with torch.inference_mode(False):
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_inference():
                    continue
                new = made.get(id(param))
                if new is None:
                    new = nn.Parameter(param.clone(), requires_grad=param.requires_grad)
                    new.__dict__.update(param.__dict__)  # _is_hf_initialized and the like
                    made[id(param)] = new
                module._parameters[name] = new
