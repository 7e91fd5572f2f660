"""peft LoRA on FP8 bases: adapters train in the compute dtype; merging gives high precision.

peft 0.21 wraps any ``nn.Linear`` subclass with its default LoRA layer, which trains fine on
an ``Fp8Linear`` (adapters take ``compute_dtype``) but cannot merge: it adds the delta into
``weight.data`` in place, and fp8 tensors do not promote. ``Fp8LoraLinear`` (registered for
``Fp8Linear`` through peft's custom-module API by the ``peft_lora`` patch,
``hf_fp8.patches.peft_lora``) swaps the FP8 base for its dequantized ``nn.Linear`` before
merging (frozen, as peft leaves a plain base). So ``merge_and_unload()`` returns a
high-precision model; ``hf_fp8.quantize_model(merged, config)`` turns it back into FP8.
``unmerge`` restores the original FP8 layer bit for bit; the kept layer follows ``.to()``, and
on a layer offloaded by accelerate (``device_map`` with ``"disk"``/``"cpu"``) the merged copy
takes over its offload hook. ``model.dequantize()`` while merged makes the merged copy the base
for good (``unmerge`` then subtracts the delta from it, as on a high-precision model).

Like peft's own ``nn.Linear`` dispatch, it forces ``fan_in_fan_out=False`` (an ``Fp8Linear``
stores ``[out, in]``, also where it replaced a GPT-2 ``Conv1D``). Where it did, the merged
layer is GPT-2's ``Conv1D`` again (``[in, out]``: the merged model saves and reloads as the
model's class) and the layer's ``fan_in_fan_out`` follows its base, ``True`` there, as peft
sets it on a ``Conv1D``: merge, unmerge and DoRA add the delta transposed, as on the float
GPT-2 (R31); ``model.dequantize()`` of a peft model also puts ``Conv1D`` bases in. The adapter
tensors are the same either way (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``).

Every LoRA variant and every init other than the plain ones (``True``/``False``/
``'gaussian'``/``'eva'``) is set up on a dequantized copy of the base (an ``nn.Linear``):
peft's inits read the base weight's values (DoRA's magnitude, MiCA's singular vectors) or
build adapter tensors in its dtype (BD-LoRA's block-diagonal factors, VeLoRA's projection, the
orthogonal init), and fp8 has no random kernels and must not round an adapter. DoRA's weight norm also reads the dequantized weight in forward. LoRA inits and
variants that rewrite the base weight (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, KaSA, and any other
init seen changing the dequantized copy) are refused: the FP8 base is frozen fp8 codes.

LoRA on FP8 MoE experts (``Fp8Experts``: ``target_parameters`` on their 3-D weights, or
``target_modules`` naming them) is refused at ``get_peft_model`` by
:func:`refuse_lora_on_experts`; experts kept in high precision take it as usual. Both refusals
come before peft changes the model (``hf_fp8.peft_preflight``, called by the ``peft_lora``
patch); should one come at its target after all, the patch puts the model back as it was.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.variants import DoraLinearVariant
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from hf_fp8.modules import Fp8Linear, is_conv1d
from hf_fp8.modules.origin import dense_layer, how_to_keep, source_class

# ``init_lora_weights`` values (prefixes) whose init subtracts the adapter from the base weight
REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# ... and those that touch neither its values nor its dtype (set up on the FP8 base itself; every
# other init and every LoRA variant gets the dequantized weight)
PLAIN_INITS = ("gaussian", "eva")


def _dense_copy(layer: Fp8Linear, *, as_source: bool = True) -> nn.Module:
    """``layer.dequantize()`` with the requires_grad flags of ``layer`` (a frozen base stays
    frozen when merged), on the device of its weight: GPT-2's ``Conv1D`` (``[in, out]``) where
    ``layer`` replaced one and ``as_source`` (a merge: the merged model saves and reloads
    as the model's class, R31), else an ``nn.Linear``.

    The parameters go straight into ``_parameters``: peft's ``init_empty_weights``
    (``low_cpu_mem_usage=True``) puts every parameter set through ``register_parameter`` on
    the meta device, but a copy of a loaded base holds its values, as the base of the same
    flow on a high-precision model does (R30 F4)."""
    bias = layer.bias
    return dense_layer(
        layer.dequantize_weight(),
        None if bias is None else bias.detach().to(layer.compute_dtype).clone(),
        source_class(layer) if as_source else None,
        weight_grad=layer.weight.requires_grad,
        bias_grad=bias is not None and bias.requires_grad,
    )


def _offload_hook(layer: Fp8Linear, target_name: str) -> Any:
    """The accelerate hook on ``layer`` that merging must carry over to its dense copy (an
    ``AlignDevicesHook``), or None; refuses, before anything changes, what cannot be merged."""
    hook = layer.__dict__.get("_hf_hook")
    if hook is None:
        return None
    from accelerate.hooks import AlignDevicesHook

    name = target_name or "this layer"
    if not isinstance(hook, AlignDevicesHook):
        raise NotImplementedError(
            f"cannot merge the LoRA adapter of {name}: its FP8 base layer carries an accelerate "
            f"hook ({type(hook).__name__}) that merging cannot carry over to the merged "
            "high-precision layer. Load the model without a device_map (or remove the hooks with "
            "accelerate.hooks.remove_hook_from_submodules), then merge"
        )
    if hook.offload and layer.weight.is_meta:
        raise ValueError(
            f"cannot merge the LoRA adapter of {name}: its FP8 base layer is offloaded "
            "(accelerate device_map) and not loaded. Merge through the model, "
            "model.merge_adapter() or model.merge_and_unload(), which loads each offloaded "
            "layer first (peft's onload_layer)"
        )
    return hook


def _carry_hook(hook: Any, original: Fp8Linear, dense: nn.Linear) -> None:
    """Give ``dense`` an ``AlignDevicesHook`` like ``hook`` (the one on ``original``), so that
    peft's ``onload_layer`` offloads the merged layer as it does a high-precision one (R30 F3);
    ``original`` goes back to its offload store, kept for ``unmerge``."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    new = AlignDevicesHook(
        execution_device=hook.execution_device,
        offload=hook.offload,
        io_same_device=hook.io_same_device,
        offload_buffers=hook.offload_buffers,
        place_submodules=hook.place_submodules,
        skip_keys=hook.skip_keys,
        tied_params_map=hook.tied_params_map,
    )
    add_hook_to_module(dense, new)  # offload: its values into a weights map, itself on meta
    if hook.offload:
        new.pre_forward(dense)  # loaded, as onload_layer left the FP8 layer
        hook.post_forward(original, torch.tensor([]))  # the FP8 layer offloaded again


def _offloaded(layer: Fp8Linear) -> bool:
    """Whether accelerate offloaded ``layer`` and it is not loaded now."""
    hook = layer.__dict__.get("_hf_hook")
    return layer.weight.is_meta and bool(getattr(hook, "offload", False))


def _onload(layer: Fp8Linear) -> None:
    """A kept, offloaded FP8 layer loaded again as it is put back (``unmerge``): peft's
    ``onload_layer`` reads the base layer's values when it offloads it on exit."""
    if _offloaded(layer):
        layer.__dict__["_hf_hook"].pre_forward(layer)


class _DequantizedBase:
    """What peft's DoRA reads of a base layer (``weight``, ``bias``), with the weight dequantized:
    peft's ``dequantize_module_weight`` returns a plain tensor as it is."""

    def __init__(self, layer: Fp8Linear) -> None:
        self.weight = layer.dequantize_weight()
        self.bias = layer.bias

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(())  # nothing to gather (peft's DeepSpeed ZeRO-3 context)


class Fp8DoraLinearLayer(DoraLinearLayer):
    """peft's DoRA magnitude over an ``Fp8Linear``: the weight norm (and, with dropout, the base
    output) use the dequantized weight."""

    def forward(self, x: torch.Tensor, *, base_layer: nn.Module, **kwargs: Any) -> torch.Tensor:
        self.fan_in_fan_out = is_conv1d(base_layer)  # the layout of the base it reads now
        if isinstance(base_layer, Fp8Linear):
            base_layer = _DequantizedBase(base_layer)
        return super().forward(x, base_layer=base_layer, **kwargs)


class Fp8DoraLinearVariant(DoraLinearVariant):
    """peft's DoRA variant; its magnitude starts as the row norm of the dequantized weight."""

    @staticmethod
    def init(module: Fp8LoraLinear, adapter_name: str, **kwargs: Any) -> None:
        # ``Fp8LoraLinear.update_layer`` runs variant inits on the dequantized base
        DoraLinearVariant.init(module, adapter_name, **kwargs)
        dora = module.lora_magnitude_vector[adapter_name]
        fp8_dora = Fp8DoraLinearLayer(fan_in_fan_out=dora.fan_in_fan_out)
        fp8_dora.weight = dora.weight
        module.lora_magnitude_vector[adapter_name] = fp8_dora


def _check_config(config: Any, target_name: str) -> None:
    """Refuse what would rewrite the frozen FP8 base weight, naming the way that works."""
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower().startswith(REWRITING_INITS):
        _refuse_rewrite(f"init_lora_weights={init!r}", target_name)
    elif getattr(config, "kasa_config", None):
        _refuse_rewrite("KaSA (kasa_config)", target_name)


def _is_plain_init(config: Any) -> bool:
    init = config.init_lora_weights
    return isinstance(init, bool) or (isinstance(init, str) and init.lower() in PLAIN_INITS)


def _changed(dense: nn.Linear, original: Fp8Linear) -> bool:
    """Whether peft wrote into the dequantized copy ``dense`` of ``original`` (values compared:
    writes through ``.data`` leave no version count)."""
    if not torch.equal(dense.weight, original.dequantize_weight()):
        return True
    if original.bias is None:
        return dense.bias is not None
    return dense.bias is None or not torch.equal(dense.bias, original.bias.to(dense.bias.dtype))


def _refuse_rewrite(what: str, target_name: str) -> None:
    raise ValueError(
        f"{what} rewrites the base weight of {target_name or 'the target'}, an FP8 layer "
        "(Fp8Linear) whose fp8 codes are frozen. Load the model in high precision for it "
        "(from_pretrained(..., quantization_config=hf_fp8.Fp8Config(..., dequantize=True)) for "
        "an FP8 checkpoint, or without quantization_config), train the adapter there, and "
        "quantize the merged model afterwards with hf_fp8.quantize_model(model, "
        "hf_fp8.Fp8Config(...)); or use a plain LoRA init (init_lora_weights=True / 'gaussian')."
    )


class Fp8LoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` over an ``Fp8Linear`` base, with a working merge and DoRA."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, **kwargs: Any):
        if config.fan_in_fan_out or kwargs.get("fan_in_fan_out"):
            # peft's dispatch does this for nn.Linear; custom modules skip its dispatch
            warnings.warn(
                "fan_in_fan_out is set to True but the target module is `Fp8Linear` (stored "
                "[out, in] like torch.nn.Linear). Setting fan_in_fan_out to False.",
                stacklevel=2,
            )
            config.fan_in_fan_out = False
            if "fan_in_fan_out" in kwargs:
                kwargs["fan_in_fan_out"] = False
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    @property
    def fan_in_fan_out(self) -> bool:
        """peft's flag, from the base layer this LoRA layer holds now: ``False`` on the FP8
        layer (``[out, in]``), ``True`` on the ``Conv1D`` that a merge or ``model.dequantize()``
        puts in place of one that replaced a GPT-2 ``Conv1D`` (``[in, out]``), as peft sets it
        for a ``Conv1D``; the merge then adds the delta transposed, as on the float model."""
        return is_conv1d(self.get_base_layer())

    @fan_in_fan_out.setter
    def fan_in_fan_out(self, value: bool) -> None:
        # peft's __init__ sets it (False: the config's flag, forced above); the base decides
        if bool(value) != self.fan_in_fan_out:
            base = type(self.get_base_layer()).__name__
            raise ValueError(
                f"fan_in_fan_out={value!r} on a LoRA layer over {base}: the flag follows the base "
                "layer (False on an Fp8Linear, stored [out, in]; True on a GPT-2 Conv1D, [in, out]) "
                "and cannot be set"
            )

    def _sync_dora_layout(self) -> None:
        """peft's DoRA merge reads the magnitude layer's own ``fan_in_fan_out``: the base's."""
        for dora in self.lora_magnitude_vector.values():
            dora.fan_in_fan_out = self.fan_in_fan_out

    @property
    def lora_variants(self) -> dict:
        return {**super().lora_variants, ("use_dora",): Fp8DoraLinearVariant}

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any, **kwargs):
        """peft's ``update_layer``; refuses the inits that rewrite the base weight and runs the
        others, and every variant, on the dequantized base (plain inits on the FP8 base)."""
        target_name = kwargs.get("target_name", "")
        _check_config(config, target_name)
        if _is_plain_init(config) and self.resolve_lora_variant(config=config) is None:
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
            return
        base = self.get_base_layer()
        if isinstance(base, Fp8Linear) and _offloaded(base):
            variant = "DoRA (use_dora=True)" if config.use_dora else "this LoRA variant"
            raise ValueError(
                f"{variant} / init_lora_weights={config.init_lora_weights!r} reads the base "
                f"weight of {target_name or 'the target'}, an FP8 layer that accelerate offloaded "
                "(device_map with 'disk' or 'cpu'), so it is not loaded here. Load the model "
                "without offloading (or with a device_map that keeps the targets on a device) "
                "for it, or use a plain LoRA (init_lora_weights=True, no variant)"
            )
        with self._dequantized_base() as dense:
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        # a model on the meta device (built to be loaded later) holds no values to compare; the
        # inits known to rewrite the base were refused by name above
        if dense is not None and not dense.weight.is_meta and _changed(dense, base):
            variant = self.lora_variant.get(adapter_name)
            variant = type(variant).__name__ if variant is not None else "none"
            self.delete_adapter(adapter_name)  # where add_adapter called this on a live layer
            what = f"init_lora_weights={config.init_lora_weights!r} (LoRA variant: {variant})"
            _refuse_rewrite(f"this LoRA config, {what},", target_name)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge into a dequantized copy of the FP8 base (which is kept for ``unmerge``)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return  # nothing to merge: the FP8 base stays as it is
        base = self.get_base_layer()
        if isinstance(base, Fp8Linear):
            hook = _offload_hook(base, base.__dict__.get("fp8_name", ""))
            dense = _dense_copy(base)
            if hook is not None:
                _carry_hook(hook, base, dense)
            self.__dict__["_fp8_base"] = base  # kept out of the module tree / state dict
            self._set_base(dense)
        # peft's DoRA merge of a further adapter unmerges and re-merges the merged ones
        # (``_unmerged_base_weight``): the dense copy must stay in place through that replay.
        depth = self.__dict__.get("_fp8_merge_depth", 0)
        self.__dict__["_fp8_merge_depth"] = depth + 1
        self._sync_dora_layout()
        try:
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        finally:
            if depth:
                self.__dict__["_fp8_merge_depth"] = depth
            else:
                del self.__dict__["_fp8_merge_depth"]
                self._restore_fp8_base()  # only when nothing got merged (an error)

    def unmerge(self) -> None:
        """Unmerge, and put the original FP8 layer back once nothing is merged."""
        self._sync_dora_layout()
        super().unmerge()
        if not self.__dict__.get("_fp8_merge_depth", 0):
            self._restore_fp8_base()

    def _restore_fp8_base(self) -> None:
        original = self.__dict__.get("_fp8_base")
        if not self.merged and original is not None:
            _onload(original)
            self._set_base(original)
            del self.__dict__["_fp8_base"]

    def _hf_fp8_dequantize(self, dtype: torch.dtype | None) -> None:
        """``model.dequantize()`` (``Fp8HfQuantizer._dequantize``) while an adapter is merged:
        the merged dense base becomes the base for good, so that ``unmerge`` subtracts the delta
        from it as peft does on a high-precision model, instead of putting the FP8 layer back
        into an unquantized model (R30 F2)."""
        if self.__dict__.pop("_fp8_base", None) is not None and dtype is not None:
            self.get_base_layer().to(dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> Fp8LoraLinear:
        """``.to()`` / ``.half()`` / ``.cuda()`` also move the FP8 layer kept for ``unmerge``
        (outside the module tree), so that it comes back where the model is (R30 F5)."""
        original = self.__dict__.get("_fp8_base")
        if recurse and original is not None:
            original._apply(fn)
        return super()._apply(fn, recurse)

    @contextlib.contextmanager
    def _dequantized_base(self) -> Iterator[nn.Linear | None]:
        """For peft code that reads the base weight once (variant and init setup): a frozen
        dense copy in its place, yielded (None where the base is not an ``Fp8Linear``)."""
        base = self.get_base_layer()
        if not isinstance(base, Fp8Linear):
            yield None
            return
        dense = _dense_copy(base, as_source=False)  # [out, in]: compared with the FP8 layer
        self._set_base(dense)
        try:
            yield dense
        finally:
            self._set_base(base)

    def _set_base(self, layer: nn.Module) -> None:
        owner = self
        while isinstance(owner.base_layer, BaseTunerLayer):
            owner = owner.base_layer
        owner.base_layer = layer


def refuse_lora_on_experts(target: nn.Module, adapter_name: str, **kwargs: Any) -> nn.Module:
    """What the ``peft_lora`` patch registers for ``Fp8Experts`` (peft's custom modules): LoRA
    on FP8 experts (``target_parameters=['mlp.experts.gate_up_proj']`` or
    ``target_modules=['experts']``) is refused when ``get_peft_model`` reaches them."""
    name = kwargs.get("target_name") or "the experts module"
    param = kwargs.get("parameter_name")
    if param and not name.endswith(f".{param}"):  # peft names the parameter's key
        name = f"{name}.{param}"
    what = f"{name} (peft target_parameters)" if param else f"{name} (peft target_modules)"
    source = getattr(getattr(target, "layout", None), "source_class", None)
    kind = f"{getattr(source, '__name__', 'MoE experts')} as Fp8Experts"
    raise NotImplementedError(
        f"LoRA on {what}, FP8 experts ({kind}), is not supported: the adapter delta would be "
        "added to fp8 codes without their per-expert scales. Put LoRA on the attention and dense "
        "layers instead (LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])); "
        f"or, to train them, keep these experts in high precision: {how_to_keep(target, ['experts'])}"
    )


def register_peft_lora() -> bool:
    """Apply the ``peft_lora`` patch now (``import hf_fp8`` does it when peft is imported).

    Returns False, with one warning naming the alternative, when peft's internals changed.
    """
    from hf_fp8.patches import apply

    return apply("peft_lora")
