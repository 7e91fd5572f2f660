"""Every change hf_fp8 makes to another library's objects, one module per patch.

=====================  ==========================================  =====================================
patch                  what it changes                              public alternative when it fails
=====================  ==========================================  =====================================
``quantizers``         transformers' quantizer registries           ``from_pretrained(...,
                       (``quant_method="hf_fp8"``)                  quantization_config=hf_fp8.Fp8Config(...))``
                                                                    then ``hf_fp8.quantize_model``
``trainer_optimizers`` ``TrainingArguments(optim="adamw_fp8...")``  ``Trainer(optimizer_cls_and_kwargs=
                       (``OptimizerNames``, ``_OPTIMIZER_HANDLERS``) (hf_fp8.AdamWFp8, {...}))``
``model_card``         ``PreTrainedModel.save_pretrained`` /        ``hf_fp8.hub.write_model_card`` /
                       ``_upload_modified_files`` (and the          ``hf_fp8.hub.push_folder``
                       ``state_dict=`` passed, checked, is saved)
``peft_lora``          ``LoraConfig.__post_init__`` registers        ``config._register_custom_module(
                       ``Fp8LoraLinear`` via peft's custom modules  {Fp8Linear: Fp8LoraLinear})``
``model_dtype``        ``PreTrainedModel.half()`` / ``.float()``     ``model.to(torch.float16)``
                       act as ``.to(dtype)`` on hf_fp8 models
``compute_dtype``      ``PreTrainedModel.dtype`` of a model whose    reload with ``dtype=`` the compute
                       first parameter is an FP8 weight is the      dtype; cast inputs to it yourself
                       FP8 layers' compute dtype, not fp8 (it is    (a config.json saying fp8 reloads
                       config.json's ``dtype``)                     in float32, with a warning)
``accelerate_fsdp2``   ``accelerator.prepare`` under FSDP2 with a    ``hf_fp8.fully_shard_fp8(model)``
                       casting ``mixed_precision`` shards FP8       before ``accelerator.prepare``
                       modules in fp8-keeping groups first
``accelerate_ddp``     ``accelerator.prepare`` in DDP mode          ``hf_fp8.ignore_fp8_for_ddp(model)``
                       (``MULTI_CPU`` / ``MULTI_GPU``) keeps fp8    before ``accelerator.prepare``
                       codes out of DDP, broadcasts them as bytes
``fp8_without_config`` ``from_pretrained`` of a local folder whose   keep ``config.json``'s
                       fp8 weights have scales but whose config     ``quantization_config``; pass no
                       has no ``quantization_config``: refused      base-model ``config=``
                       (it would load as garbage)
``resize_embeddings``  ``PreTrainedModel.resize_token_embeddings``  resize the embeddings before
                       refuses to resize an FP8 ``lm_head``         quantizing, or keep the head:
                       (transformers would crash half-way, or       ``Fp8Config(modules_to_not_convert=
                       copy fp8 codes without their scales)         ["lm_head"])``
=====================  ==========================================  =====================================

Each patch is applied on its own, when the library it changes is imported (see
:func:`install`), inside ``try``/``except``: a failure disables only that feature, with one
:class:`PatchWarning` that names the public alternative. ``import hf_fp8`` and
``from_pretrained`` never fail because a private name moved. :func:`status` tells what is on.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from dataclasses import dataclass

import _hf_fp8_autoload


class PatchWarning(UserWarning):
    """An integration with another library is off (its internals changed)."""


@dataclass(frozen=True)
class Patch:
    """One patch: its module (``apply()``, and ``TRIGGERS``: module name -> step), the modules
    whose import triggers it, the feature and the way around it."""

    module: str
    triggers: tuple[str, ...]
    feature: str
    alternative: str


PATCHES: dict[str, Patch] = {
    "quantizers": Patch(
        "hf_fp8.patches.quantizers",
        ("transformers.quantizers", "transformers.modeling_utils"),
        'loading checkpoints with quant_method="hf_fp8" by from_pretrained',
        "quantize after loading the high-precision model: "
        "hf_fp8.quantize_model(model, hf_fp8.Fp8Config(...))",
    ),
    "trainer_optimizers": Patch(
        "hf_fp8.patches.trainer_optimizers",
        ("transformers.training_args", "transformers.trainer_optimizer"),
        'TrainingArguments(optim="adamw_fp8_coat" / "adamw_fp8")',
        "Trainer(..., optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, "
        "{'lr': ..., 'dynamic_range_expansion': True}))",
    ),
    "model_card": Patch(
        "hf_fp8.patches.model_card",
        ("hf_fp8.quantizer.hf_quantizer",),
        "hf_fp8 model cards, atomic saves and the state dict passed "
        "(save_pretrained(state_dict=...)) in save_pretrained / push_to_hub",
        "write the card yourself: hf_fp8.hub.write_model_card(folder, "
        "hf_fp8.hub.info_from_model(model)), and upload with hf_fp8.hub.push_folder(folder, repo_id)",
    ),
    "peft_lora": Patch(
        "hf_fp8.patches.peft_lora",
        ("peft.tuners.lora.config",),
        "merge_and_unload() of LoRA adapters on FP8 layers; refusing peft modules_to_save / "
        "trainable tokens / LoRA on experts / methods other than LoRA on FP8 layers",
        "lora_config._register_custom_module({hf_fp8.Fp8Linear: hf_fp8.lora.Fp8LoraLinear}) "
        "before get_peft_model, or merge into model.dequantize()",
    ),
    "model_dtype": Patch(
        "hf_fp8.patches.model_dtype",
        ("transformers.modeling_utils",),
        "model.half() / model.float() on hf_fp8 models",
        "model.to(torch.float16) / model.to(torch.float32)",
    ),
    "compute_dtype": Patch(
        "hf_fp8.patches.compute_dtype",
        ("transformers.modeling_utils",),
        "model.dtype is the compute dtype of hf_fp8 models whose first parameter is an FP8 "
        "weight (else it says fp8, and save_pretrained writes fp8 as config.json's dtype)",
        "cast inputs to the compute dtype yourself; a config.json saying dtype float8_e4m3fn "
        "reloads in float32 with a warning, or pass from_pretrained(..., dtype=torch.bfloat16)",
    ),
    "accelerate_ddp": Patch(
        "hf_fp8.patches.accelerate_ddp",
        ("accelerate.accelerator",),
        "DistributedDataParallel of FP8 models by accelerator.prepare (MULTI_CPU / MULTI_GPU)",
        "model.to(accelerator.device); hf_fp8.ignore_fp8_for_ddp(model) before "
        "accelerator.prepare(model, ...)",
    ),
    "fp8_without_config": Patch(
        "hf_fp8.patches.fp8_without_config",
        ("transformers.modeling_utils",),
        "refusing FP8 checkpoints loaded without their quantization_config (fp8 codes read "
        "as plain weights, scales dropped)",
        "check that config.json keeps its quantization_config (hf-fp8 inspect FOLDER) and "
        "pass no base-model config= to from_pretrained",
    ),
    "accelerate_fsdp2": Patch(
        "hf_fp8.patches.accelerate_fsdp2",
        ("accelerate.accelerator",),
        "fp8 codes kept fp8 by accelerator.prepare under FSDP2 with mixed_precision bf16/fp16",
        "call hf_fp8.fully_shard_fp8(model) before accelerator.prepare(model, optimizer, ...)",
    ),
    "resize_embeddings": Patch(
        "hf_fp8.patches.resize_embeddings",
        ("transformers.modeling_utils",),
        "a clear error from resize_token_embeddings on a model whose lm_head is an FP8 layer "
        "(else transformers fails half-way in torch, or copies fp8 codes without their scales)",
        "resize the token embeddings before quantizing, or keep lm_head in high precision: "
        "Fp8Config(modules_to_not_convert=['lm_head'])",
    ),
}

_LOCK = threading.RLock()
_STATUS: dict[str, str] = {}  # name -> "off: <reason>" | "partly off: <reason>"


def _disable(name: str, reason: str, *, partly: bool = False) -> None:
    """Record ``name`` as off and warn once (per patch and process)."""
    with _LOCK:
        if _STATUS.get(name, "").startswith(("off", "partly off")):
            return
        _STATUS[name] = f"{'partly off' if partly else 'off'}: {reason}"
    patch = PATCHES[name]
    warnings.warn(
        f"hf_fp8: {patch.feature} is {'partly ' if partly else ''}disabled ({reason}); "
        f"instead: {patch.alternative}",
        PatchWarning,
        stacklevel=3,
    )


def disable(name: str, reason: str, *, partly: bool = False) -> None:
    """For patch modules: switch (part of) a feature off with its one warning."""
    _disable(name, reason, partly=partly)


def apply(name: str, *, strict: bool = False, step: str | None = None) -> bool:
    """Apply patch ``name`` (or its ``step``, one of its ``TRIGGERS`` callbacks); idempotent.

    Returns False when the patch is off. On failure: with ``strict`` raise ``RuntimeError``
    naming the public alternative; otherwise warn once and return False.
    """
    patch = PATCHES[name]
    try:
        module = importlib.import_module(patch.module)
        func = module.TRIGGERS[step] if step is not None else module.apply
        with _LOCK:
            func()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if strict:
            raise RuntimeError(
                f"hf_fp8: {patch.feature} is unavailable ({reason}); instead: {patch.alternative}"
            ) from exc
        _disable(name, reason)
        return False
    return not _STATUS.get(name, "").startswith("off")


def status() -> dict[str, str]:
    """``{patch: "on" | "pending" | "off: reason" | "partly off: reason"}``, read from the
    patched objects themselves ("pending": the library is not imported yet)."""
    _hf_fp8_autoload.check_pending()
    result = {}
    for name, patch in PATCHES.items():
        recorded = _STATUS.get(name, "")
        if recorded.startswith("off"):
            result[name] = recorded
            continue
        applied = importlib.import_module(patch.module).applied()
        result[name] = recorded or "on" if applied else "pending"
    return result


def _trigger(name: str, step: str):
    return lambda module: apply(name, step=step)


def _quiet_import():
    from hf_fp8._quiet import quiet_import  # logging + contextlib: only when needed

    return quiet_import()


_INSTALLED = False


def install() -> None:
    """Defer each patch until the module it changes is imported (at once if it already is)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    _hf_fp8_autoload.around_import("transformers.quantizers.auto", _quiet_import)
    for name, patch in PATCHES.items():
        for step in patch.triggers:
            _hf_fp8_autoload.when_imported(step, _trigger(name, step))


__all__ = ["PATCHES", "Patch", "PatchWarning", "apply", "disable", "install", "status"]
