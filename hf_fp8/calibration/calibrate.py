"""``calibrate``: static FP8 activation scales from data."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_fp8.calibration.batches import ACCEPTED, as_batches, check_batch
from hf_fp8.calibration.experts import ExpertsObservation, is_static_experts, parents_of
from hf_fp8.calibration.masking import TokenMask
from hf_fp8.calibration.observers import Observer, make_observer
from hf_fp8.calibration.recipes import observing_recipe
from hf_fp8.modules import Fp8Linear
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts
from hf_fp8.numerics import fp8_dtype

# ``hook(model)`` run after ``calibrate`` set new static scales. Upper layers add theirs
# (hf_fp8.hub: fidelity figures measured with the old scales leave the model card), so this
# layer imports none of them.
CALIBRATED_HOOKS: list[Callable[[nn.Module], None]] = []


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _run(model: nn.Module, batch: Any) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (list, tuple)):
        model(*batch)
    else:
        model(batch)


def _positional_names(model: nn.Module) -> tuple[str, ...]:
    """The names ``model(*batch)`` binds a tuple batch's tensors to (empty: unknown)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    names = []
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def _length(data: Any) -> int | None:
    """``len(data)``, or None when it has none: a ``DataLoader`` over an
    ``IterableDataset`` defines ``__len__`` and raises ``TypeError`` (R27 F2)."""
    try:
        return len(data)
    except TypeError:
        return None


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _warn_nonfinite(observers: dict[str, Observer]) -> None:
    hit = [f"{name} ({obs.nonfinite} value(s))" for name, obs in observers.items() if obs.nonfinite]
    if hit:
        warnings.warn(
            f"calibrate: {len(hit)} static layer(s) saw non-finite activations (NaN / inf), "
            f"left out of their scales: {_names(hit)}. The model overflows on some "
            "calibration inputs (float16?); it will on the same inputs at inference too",
            UserWarning,
            stacklevel=4,
        )


def _warn_untraced(experts: dict[str, ExpertsObservation]) -> None:
    hit = [f"{name} ({obs.untraced} call(s))" for name, obs in experts.items() if obs.untraced]
    if hit:
        warnings.warn(
            f"calibrate: the rows of {len(hit)} parallel experts module(s) could not be traced "
            f"to their tokens in padded batches: {_names(hit)}. Their padded positions' rows "
            "count in their input scales (no module next to them returned the expert_size "
            "they were called with together with one index of every token, as JetMoE's router "
            "does). Calibrate with unpadded batches (one sequence per batch, or sequences of "
            "one length) to keep padding out of these scales",
            UserWarning,
            stacklevel=4,
        )


def _fallback(observers: dict[str, Observer], current: dict[str, float | None]) -> dict[str, float]:
    """Scales for layers whose observer has no information, with one warning naming them.

    ``current``: the scale each layer had before calibration (``None``: none).
    """
    zeros = [n for n, o in observers.items() if o.batches and not o.has_information()]
    idle = [n for n, o in observers.items() if not o.batches]
    if not zeros and not idle:
        return {}
    calibrated = [float(o.scale()) for o in observers.values() if o.has_information()]
    if not calibrated:
        raise ValueError(
            "calibrate: no static layer saw a nonzero activation "
            f"({len(zeros)} saw only zeros, {len(idle)} saw no tokens): check the batches"
        )
    largest = max(calibrated)
    scales = {}
    for name in zeros + idle:
        scales[name] = largest if current.get(name) is None else current[name]
    parts = [f"saw only zeros: {_names(zeros)}"] if zeros else []
    parts += [f"saw no tokens: {_names(idle)}"] if idle else []
    warnings.warn(
        f"calibrate: {len(zeros) + len(idle)} of {len(observers)} static layers have no usable "
        f"activations ({'; '.join(parts)}). They keep their input_scale if "
        f"they had one, else take the largest calibrated scale ({largest:.4g}) instead of a "
        "tiny scale that would saturate every nonzero input. Calibrate with data that reaches "
        "them, or set their scales with Fp8Config(activation_scales={...})",
        UserWarning,
        stacklevel=4,
    )
    return scales


def _refuse_offloaded(layers: dict[str, Fp8Linear], experts: dict[str, ExpertsObservation]) -> None:
    """Refuse static layers whose tensors are on the meta device (offloaded by accelerate's
    hooks, which read them from disk / CPU at forward time): a scale written into such a
    module would not be used by the forward nor saved."""
    offloaded = [name for name, m in layers.items() if m.weight.is_meta]
    offloaded += [
        name
        for name, obs in experts.items()
        if any(getattr(obs.module, proj).is_meta for proj in obs.module.layout.projections)
    ]
    if offloaded:
        raise ValueError(
            f"calibrate: {len(offloaded)} static layer(s) are offloaded (their tensors are on "
            f"the meta device, read from disk or CPU at forward time): {_names(offloaded)}. "
            "New input scales cannot be written into an offloaded layer (the forward and "
            "save_pretrained would keep the old ones). Calibrate the model loaded without "
            "offloading, save_pretrained it, then reload the saved folder with this device_map"
        )


def _world(distributed: bool | None) -> int:
    """The number of ranks to agree with: the default process group's size with
    ``distributed=True``, else 1 (``None`` on several ranks warns: ranks may disagree)."""
    import torch.distributed as dist

    if not distributed or not dist.is_available() or not dist.is_initialized():
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed is None and several:
            warnings.warn(
                f"hf_fp8.calibrate ran on rank {dist.get_rank()}'s batches only: ranks "
                "that calibrate on their own data end with different input scales. If "
                "every rank calls calibrate, pass distributed=True (the ranks then agree); "
                "if one rank calibrates before the model is wrapped (DDP / FSDP "
                "broadcast its scales), pass distributed=False to silence this",
                UserWarning,
                stacklevel=4,
            )
        return 1
    return dist.get_world_size()


def _collective_device(model: nn.Module) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    device = next(model.parameters()).device
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _reduce_minmax(observers: dict[str, Observer], seen: int, device: torch.device) -> int:
    """Every rank's minmax observers become those of one process that saw all ranks'
    batches (the max of the amaxes, the sums of the counts): the scales are then exact and
    equal on every rank. Returns the batches seen on all ranks."""
    import torch.distributed as dist

    names = sorted(observers)
    amax = torch.stack([observers[n].amax().float().reshape(()) for n in names]).to(device)
    counts = torch.tensor(
        [[observers[n].batches, observers[n].nonfinite] for n in names] + [[seen, 0]],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    amax, counts = amax.cpu(), counts.cpu()
    for i, name in enumerate(names):
        observers[name]._amax = amax[i].clone()
        observers[name].batches = int(counts[i, 0])
        observers[name].nonfinite = int(counts[i, 1])
    return int(counts[-1, 0])


def _broadcast_scales(scales: dict[str, float], device: torch.device) -> dict[str, float]:
    """Rank 0's scales on every rank (observers whose statistics do not reduce exactly)."""
    import torch.distributed as dist

    names = sorted(scales)
    values = torch.tensor([scales[n] for n in names], dtype=torch.float64, device=device)
    dist.broadcast(values, src=0)
    return dict(zip(names, values.cpu().tolist(), strict=True))


def calibrate(
    model: nn.Module,
    batches: Any,
    observer: str = "minmax",
    *,
    progress: bool = True,
    distributed: bool | None = None,
    **observer_kwargs: Any,
) -> dict[str, float]:
    """Set the ``input_scale`` of every static ``Fp8Linear`` and ``Fp8Experts`` from ``batches``.

    ``batches``: one batch (a dict / ``BatchEncoding`` of tensors, e.g. a tokenizer's output
    with ``return_tensors="pt"``, or a tensor of token ids), a list of batches, or any
    iterable of batches such as a ``DataLoader``. A batch is a dict (``model(**batch)``), a
    tuple of tensors (``model(*batch)``) or a tensor. Anything else (e.g. a list of strings)
    raises ``TypeError`` saying what to pass; so do a bare tuple of tensors (one batch of
    positional inputs, or several batches?) and a list whose tensor looks like the attention
    mask of the one before it (``[input_ids, attention_mask]``): pass one batch as a dict or
    ``[(input_ids, attention_mask)]``, several as a list of such batches.

    ``observer``: ``"minmax"``, ``"moving_average"`` (``momentum=0.9``), ``"percentile"``
    (``percentile=99.99``) or ``"mse"``. During calibration the static layers run with
    high-precision activations; every module's train/eval flag is restored as it was.

    Padding is not observed: a dict batch's ``attention_mask`` (``[batch, seq]``, and
    ``decoder_attention_mask``) selects the positions whose activations set the scales, in
    every layer whose input is laid out per token (``[batch, seq, ...]`` or flattened
    ``[batch * seq, ...]``), and the expert rows of real tokens; an input laid out otherwise
    is observed whole (see ``hf_fp8.calibration.masking``). An expert reached only by padding
    counts as one that saw no tokens. Parallel experts (JetMoE: rows gathered by the caller)
    keep the rows of real tokens, traced through their router's token index; rows that
    cannot be traced are observed whole, with a warning naming the module
    (``hf_fp8.calibration.experts``).

    NaN / inf activations are left out of the scales, with one warning naming the layers.
    Layers that see only zeros, or no token at all, keep the ``input_scale`` they had, or
    else take the largest scale calibrated in the model, with one warning naming them.
    Static ``Fp8Experts`` get one scale per expert and projection, from the rows routed to
    that expert (an expert no token reached falls back as above).
    Returns the scales by module name (``"<experts>.<proj>[<expert>]"`` for experts).
    A model with offloaded static layers (``device_map`` with ``"disk"``, CPU offload) is
    refused before any batch runs: calibrate it without offloading, save, and reload.

    Several ranks (``torch.distributed`` initialized, world size above 1, e.g. DDP or
    FSDP2 training, each rank with its own share of the data): with ``distributed=True``
    every rank of the default process group must call ``calibrate`` (it is a collective),
    and every rank ends with the same scales. With ``"minmax"`` the observed maxima are
    reduced across ranks: the scales are exactly those of one process calibrating on all
    ranks' batches. The other observers' statistics do not reduce exactly: rank 0's scales
    are broadcast to every rank (calibrate rank 0 on enough data). The default (``None``)
    calibrates each rank alone, as a collective would hang when only one rank calls it (the
    "main process quantizes" pattern), and warns on several ranks that their scales may
    differ; ``distributed=False`` calibrates each rank alone without the warning.

    A ``torch.compile``'d model (``fullgraph=True`` included) runs its calibration batches
    eagerly (``torch.compiler.set_stance("force_eager")``): the observers read activations
    in Python; the compiled graph is used again afterwards.
    """
    with torch.no_grad():
        return _calibrate(model, batches, observer, progress, distributed, observer_kwargs)


def _eager() -> Any:
    """A context running ``torch.compile``'d code eagerly (nothing before torch 2.6)."""
    import contextlib

    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _calibrate(
    model: nn.Module,
    batches: Any,
    observer: str,
    progress: bool,
    distributed: bool | None,
    observer_kwargs: dict,
) -> dict[str, float]:
    data = as_batches(batches)
    make = functools.partial(make_observer, observer, **observer_kwargs)
    layers = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear) and m.activation_scheme == "static"
    }
    config = getattr(model, "config", None)
    token_mask = TokenMask(
        bool(getattr(config, "is_encoder_decoder", False)), _positional_names(model)
    )
    experts = {
        name: ExpertsObservation(
            m,
            functools.partial(make, fp8_dtype(m.fp8_format)),
            token_mask,
            parents_of(model, m) if isinstance(m, Fp8ParallelExperts) else (),
        )
        for name, m in model.named_modules()
        if is_static_experts(m)
    }
    if not layers and not experts:
        raise ValueError(
            "the model has no static FP8 layers to calibrate: load or quantize it with "
            "Fp8Config('static')"
        )
    _refuse_offloaded(layers, experts)
    observers = {name: make(fp8_dtype(m.fp8_format)) for name, m in layers.items()}
    current: dict[str, float | None] = {
        name: None if m.input_scale is None or m.input_scale.is_meta else float(m.input_scale)
        for name, m in layers.items()
    }
    for name, obs in experts.items():
        for key, expert_observer in obs.names(name).items():
            observers[key] = expert_observer
            proj, _, expert = key[len(name) + 1 : -1].partition("[")
            current[key] = obs.current_scale(proj, int(expert))
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, args, obs=observers[name]: obs.update(token_mask.rows(args[0]))
        )
        for name, m in layers.items()
    ]
    # each module's own flag (R27 F8): model.train(flag) would set every submodule to one
    was_training = {m: m.training for m in model.modules()}
    recipes = {name: m.recipe for name, m in layers.items()}  # put back as they are
    installed: list[ExpertsObservation] = []
    device = next(model.parameters()).device
    seen = 0
    try:
        for name, m in layers.items():
            m.set_recipe(observing_recipe(recipes[name]))  # observe unquantized activations
        for obs in experts.values():
            obs.install()
            installed.append(obs)
        model.eval()
        total = _length(data)
        for batch in tqdm(data, total=total, desc="calibrating", disable=not progress):
            check_batch(seen, batch)
            batch = _to_device(batch, device)
            token_mask.set(batch)  # padding is not observed (R27 F1)
            with _eager():  # a compiled model cannot trace the observers (R34 F3)
                _run(model, batch)
            seen += 1
    finally:
        for h in hooks:
            h.remove()
        for name, m in layers.items():
            m.set_recipe(recipes[name])
        for obs in installed:
            obs.remove()
        token_mask.clear()
        for module, training in was_training.items():
            module.training = training
    world = _world(distributed)
    if world > 1:
        device = _collective_device(model)
        if observer == "minmax":  # before any raise: every rank takes part (R34 F2)
            seen = _reduce_minmax(observers, seen, device)
    if not seen:
        raise ValueError(f"calibrate got no batches: pass {ACCEPTED}")
    _warn_nonfinite(observers)
    _warn_untraced(experts)
    scales = _fallback(observers, current)
    for name, obs in observers.items():
        if name not in scales:
            scales[name] = float(obs.scale())
    if world > 1 and observer != "minmax":
        scales = _broadcast_scales(scales, device)
    for name, m in layers.items():
        m.set_input_scale(scales[name])
        m.__dict__.pop("_saturation", None)  # counts under the old scale (R27 F5)
    for name, obs in experts.items():
        obs.apply(name, scales)
    for hook in CALIBRATED_HOOKS:
        hook(model)
    return scales
