"""``AdamWFp8``: AdamW whose two moments are stored in 8 bits per element, per group.

By default (``moment_format="fp8"``) both moments are float8 codes: COAT's paper format
(``*_fp8`` float8, ``*_scale = amax / fp8_max`` and, with expansion, ``*_exponent`` for both
moments; ≈ 2.13 bytes/parameter, 2.06 without expansion). ``moment_format="log"`` is a
measured alternative that is not FP8 (:mod:`hf_fp8.numerics.log_moments`): less than half the
update error and a 3x faster step on the CPU (``benchmarks/bench_optim_fidelity.py``,
``bench_optim.py``). State of a quantized parameter ``p`` with it (``rows = p.shape[0]``,
``cols = p.numel() // rows``, ``Gc = ceil(cols / group_size)``; groups are ``group_size``
consecutive elements of a row, so they survive FSDP2's dim-0 sharding)::

    step                  fp32 scalar (CPU)
    exp_avg_fp8           int8 [rows, Gc·group_size]  m·2^-e, absmax per group (zero padding)
    exp_avg_scale         fp32 [rows, Gc]             amax(m·2^-e) / 127
    exp_avg_sq_fp8        uint8 [rows, Gc·group_size] v, codes uniform in Mitchell's log
    exp_avg_sq_scale      fp32 [rows, Gc]             amax(v)
    exp_avg_sq_exponent   fp32 [rows, Gc]             COAT's k

≈ 2.09 bytes/parameter (fp32 AdamW: 8). A parameter is quantized when it has ≥ 2 dims, ≥ ``min_quantize_numel`` (4096) elements and
rows long enough that the padded state is smaller than fp32 (≥ 35 columns at group_size
128); the others (biases, norms, tiny tensors) keep fp32 ``exp_avg`` / ``exp_avg_sq`` and
follow ``torch.optim.AdamW`` exactly.

The second moment is written back with stochastic rounding by default
(``stochastic_rounding="exp_avg_sq"``): with β2 = 0.999 it moves by 0.1 % a step while one
code step is 4–12 %, so round-to-nearest keeps returning the old code and the stored moment
stops following its decay. The random bits are a hash of (``seed``, step, parameter index,
element): resuming and FSDP2 sharding draw the same bits. Measured update-direction errors:
``benchmarks/bench_optim_fidelity.py`` and the oracle study ``bench_optim_oracle.py``.
"""

from __future__ import annotations

import contextlib
import numbers
import signal
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from hf_fp8.kernels.compiled import compile_enabled
from hf_fp8.numerics import coat, log_moments
from hf_fp8.numerics.formats import fp8_dtype
from hf_fp8.optim import _cpu_kernel, _step
from hf_fp8.optim._layout import (
    MOMENT_FORMATS,
    is_dtensor,
    is_quantized_state,
    local,
    new_fp32_state,
    new_quantized_state,
    quantizable_placements,
    quantized_states,
    resolved_format,
    row_offset,
)
from hf_fp8.optim._state_check import (
    RESTART_FIX,
    OptimizerStateError,
    validated_state,
    wants_quantized,
)

IMPLEMENTATIONS = ("auto", "cpu_kernel", "compile", "reference")
DEFAULT_MIN_QUANTIZE_NUMEL = 4096
# Options that define the state format: loading a state saved with others is an error.
FORMAT_OPTIONS = ("group_size", "fp8_format", "dynamic_range_expansion", "sqrt_second_moment")
# (moment_format is compared resolved: "auto" and what it stands for are the same format)
STOCHASTIC_ROUNDING = (False, True, "exp_avg_sq")
# The version of the stored codes and their rounding, saved in every param group of
# state_dict(): a state of a newer hf_fp8 (newer format) is refused; one without it (an older
# hf_fp8, torch's AdamW) is read as this format. Raise it when the codes or rounding change.
STATE_FORMAT = 1
STATE_FORMAT_KEY = "hf_fp8_state_format"
# The fix for a loaded state whose parameter groups do not match (R26 finding 2). Without
# optimizer.pt, transformers' Trainer (5.24) loads neither it nor scheduler.pt.
GROUP_MISMATCH_FIX = (
    "Build the optimizer over the same trainable parameters and parameter groups as the run "
    "that saved this state (the same model, frozen layers, adapter / LoRA targets and "
    f"weight-decay grouping), or {RESTART_FIX}"
)
# Options a loaded param group replaces silently, as torch.optim replaces lr / betas / eps /
# weight_decay; AdamWFp8 warns when the user set one of these to another value (R37 finding 2).
RESUMED_OPTIONS = ("stochastic_rounding", "seed", "min_quantize_numel")
# Trainer names (hf_fp8.optim.trainer_registry) by dynamic_range_expansion, for the errors.
TRAINER_NAMES = {True: "adamw_fp8_coat", False: "adamw_fp8"}
# AdamWFp8's own param-group options (not torch.optim.AdamW's): left out of torch_state_dict().
OWN_OPTIONS = (
    "dynamic_range_expansion",
    "group_size",
    "fp8_format",
    "min_quantize_numel",
    "stochastic_rounding",
    "sqrt_second_moment",
    "moment_format",
    "seed",
)
# Flags of torch.optim.AdamW / Adam groups that are not AdamWFp8 options: dropped when such a
# state is loaded (amsgrad / maximize True and Adam's L2 weight decay are refused instead).
TORCH_ONLY_KEYS = (
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


class _DefaultInt(int):
    """The default of an option, told apart (by identity) from the same value passed."""


class _DefaultStr(str):
    """The default of an option, told apart (by identity) from the same value passed."""


_DEFAULTS = {
    "min_quantize_numel": _DefaultInt(DEFAULT_MIN_QUANTIZE_NUMEL),
    "stochastic_rounding": _DefaultStr("exp_avg_sq"),
    "seed": _DefaultInt(0),
}


def _plain(value: Any) -> Any:
    """``value`` as a plain ``int`` / ``str`` where it is one of :data:`_DEFAULTS`."""
    if type(value) is _DefaultInt:
        return int(value)
    if type(value) is _DefaultStr:
        return str(value)
    return value


# torch.compile(optimizer.step): the step runs eagerly (a graph break; its fused C kernel or its
# own torch.compile'd update are the fast paths); under fullgraph=True dynamo raises with this.
_NOT_COMPILED = (
    "AdamWFp8.step is not traced by torch.compile: it runs eagerly, with its own fast paths "
    "(the fused C kernel on CPU, a torch.compile'd update elsewhere). Call optimizer.step() "
    "outside torch.compile, or compile it without fullgraph=True (a graph break)"
)


class AdamWFp8(Optimizer):
    """AdamW with FP8 moments and COAT dynamic range expansion.

    Args:
        params: parameters or param groups (each group may override every option below
            except ``implementation``).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``lr`` may be a tensor; 0-d
            tensor betas are read as floats).
        dynamic_range_expansion: COAT's per-group power transform (``False``: plain
            per-group absmax FP8).
        group_size: consecutive elements of a row sharing one scale.
        fp8_format: ``"e4m3"`` (default) or ``"e5m2"``.
        min_quantize_numel: tensors with fewer elements (and all 1-D tensors) keep fp32
            states.
        stochastic_rounding: ``"exp_avg_sq"`` (default): the second moment is cast to fp8
            with stochastic rounding (unbiased: its slow β2 decay is kept in expectation,
            where round-to-nearest returns the same code every step); ``True``: both
            moments; ``False``: round-to-nearest (the COAT paper). Reproducible: the random bits
            are a hash of (``seed``, step, parameter index, element), so a resumed or
            FSDP2-sharded run draws the same bits.
        sqrt_second_moment: store ``sqrt(v)`` instead of ``v`` (``moment_format="fp8"`` only;
            measured worse: stochastic rounding of the root biases ``v`` upwards).
        moment_format: ``"fp8"`` (default): both moments as E4M3/E5M2 codes (COAT's paper
            format with expansion, plain absmax without). ``"auto"``: ``"log"`` unless an
            fp8-only option is set (``dynamic_range_expansion=False``, ``fp8_format="e5m2"``,
            ``sqrt_second_moment=True``), then ``"fp8"``. ``"log"`` (not FP8): ``v`` as unsigned 8-bit
            codes uniform in Mitchell's logarithm with COAT's per-group exponent, ``m`` as int8
            absmax of ``m·2^-e`` (``2^e ≈ sqrt(v̂)``) — no log2/exp2 in the step, 2.09
            bytes/parameter, about a third of the update error of the fp8 codes
            (0.018 vs 0.052 at 300 steps; :mod:`hf_fp8.numerics.log_moments`).
        seed: seed of the stochastic rounding streams.
        amsgrad: must be ``False`` (not supported).
        maximize, foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s flags,
            accepted where they change nothing (``foreach`` any of ``None`` / ``False`` /
            ``True``; ``fused`` ``None`` / ``False``; the others ``False``), so that AdamW's
            keyword arguments carry over; other values raise ``ValueError``.
        implementation: ``"auto"`` (fused C kernel for CPU tensors, else ``torch.compile``
            of the reference step, falling back to the reference if compilation fails),
            ``"cpu_kernel"`` (raises when the C kernel cannot run: no silent fallback),
            ``"compile"`` or ``"reference"`` (eager torch). All give the same results; the
            reference and the C kernel are bit-identical.

    Usage (``import hf_fp8`` registers the Trainer names)::

        opt = hf_fp8.AdamWFp8(model.parameters(), lr=3e-4, weight_decay=0.1)
        TrainingArguments(..., optim="adamw_fp8_coat")  # COAT expansion
        TrainingArguments(..., optim="adamw_fp8", optim_args="group_size=64")  # plain FP8
        # public Trainer route, independent of transformers' internals:
        Trainer(model, args, optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {"lr": 3e-4}))

    Non-finite gradients give non-finite parameters, as with ``torch.optim.AdamW``: one NaN or
    inf gradient element makes that one weight non-finite, never its group (a NaN element is
    left out of the group's maxima and stores zero codes; an inf saturates the group's
    maximum), and the quantized state stays finite and reloads (states kept in fp32 follow
    torch and hold the NaN / inf, which ``load_state_dict`` refuses). Plain FP8 never stores a non-zero
    second moment as 0 (it rounds up to the smallest code: no ``m / eps`` update). Moments
    and the update are fp32 for every parameter dtype; float64 weights are decayed and updated
    in float64 (never rounded to fp32), but float64 gradients beyond the fp32 range
    (``|g| > 3.4e38``) overflow the fp32 moments: NaN weights. A refused step (a sparse gradient,
    a tensor ``implementation="cpu_kernel"`` cannot take, parameters with gradients that share
    memory or overlap themselves, a format option changed in a live param group whose moments
    were stored with another) raises before any weight or state changes; an error after the C
    kernel ran leaves what it updated applied (the exception carries a note: restore a
    checkpoint). Every step bumps the weights' autograd version, as ``torch.optim.AdamW``.
    ``torch_state_dict()`` is a state ``torch.optim.AdamW`` (or an AdamWFp8 of another format)
    loads with fp32 moments; the optimizer itself pickles (``state_dict()`` with fp8 moments
    goes through ``torch.save``: plain pickle cannot rebuild float8 tensors).
    Ctrl-C (or SIGTERM with a Python handler) during a step in the main thread: the step
    completes, then the handler runs (``KeyboardInterrupt`` after the step); a second Ctrl-C
    during the same step interrupts at once. ``state_dict()`` records the state format
    (``hf_fp8_state_format``); a state of a newer format is refused.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        dynamic_range_expansion: bool = True,
        group_size: int = 128,
        fp8_format: str = "e4m3",
        min_quantize_numel: int = _DEFAULTS["min_quantize_numel"],
        stochastic_rounding: bool | str = _DEFAULTS["stochastic_rounding"],
        sqrt_second_moment: bool = False,
        moment_format: str = "fp8",
        seed: int = _DEFAULTS["seed"],
        amsgrad: bool = False,
        implementation: str = "auto",
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("AdamWFp8 does not support amsgrad=True (use torch.optim.AdamW)")
        _check_torch_flags(
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={implementation!r} is not supported; use one of {IMPLEMENTATIONS}"
            )
        self.implementation = implementation
        self._compiled: Callable | None = None
        self._warned: set[str] = set()
        # id(group) -> (group, the format options its stored moments were written with)
        self._formats: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        # RESUMED_OPTIONS the user passed (not left at their defaults), and per param group
        # id(group) -> (group, {option: the value the user set}): a loaded state that replaces
        # one with another value warns
        passed = {
            "min_quantize_numel": min_quantize_numel,
            "stochastic_rounding": stochastic_rounding,
            "seed": seed,
        }
        self._passed = frozenset(k for k, v in passed.items() if v is not _DEFAULTS[k])
        self._explicit: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        min_quantize_numel, stochastic_rounding, seed = (
            _plain(min_quantize_numel),
            _plain(stochastic_rounding),
            _plain(seed),
        )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "dynamic_range_expansion": dynamic_range_expansion,
            "group_size": group_size,
            "fp8_format": fp8_format,
            "min_quantize_numel": min_quantize_numel,
            "stochastic_rounding": stochastic_rounding,
            "sqrt_second_moment": sqrt_second_moment,
            "moment_format": moment_format,
            "seed": seed,
        }
        _validate_group(defaults)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """For pickle, ``copy.deepcopy`` and ``torch.save(optimizer)``: fp8 codes travel as their
        uint8 bytes (:class:`_Fp8Codes`; plain pickle cannot rebuild float8 storages, R29
        finding 5), with the implementation and the options the moments were stored with."""
        state = super().__getstate__()
        groups = state["param_groups"]
        records = [self._formats.get(id(g)) for g in groups]
        explicit = [self._explicit.get(id(g)) for g in groups]
        return {
            **state,
            "state": _codes_as_bytes(state["state"]),
            "implementation": self.implementation,
            "_state_formats": [
                r[1] if r and r[0] is g else None for r, g in zip(records, groups, strict=True)
            ],
            # what the user set travels too: a copy still warns when a load replaces it (R43)
            "_passed": self._passed,
            "_explicit_options": [
                r[1] if r and r[0] is g else None for r, g in zip(explicit, groups, strict=True)
            ],
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        formats = state.pop("_state_formats", None)
        explicit = state.pop("_explicit_options", None)
        if "state" in state:
            state["state"] = _codes_from_bytes(state["state"])
        super().__setstate__(state)
        self.__dict__.setdefault("implementation", "auto")
        self.__dict__.setdefault("_compiled", None)
        self.__dict__.setdefault("_warned", set())
        self.__dict__.setdefault("_formats", {})
        self.__dict__.setdefault("_passed", frozenset())
        self.__dict__.setdefault("_explicit", {})
        if formats is not None:
            self._formats = {
                id(g): (g, rec)
                for g, rec in zip(self.param_groups, formats, strict=False)
                if rec is not None
            }
        if explicit is not None:
            self._explicit = {
                id(g): (g, rec)
                for g, rec in zip(self.param_groups, explicit, strict=False)
                if rec is not None
            }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating its hyper-parameters and parameters."""
        given = set(param_group) if isinstance(param_group, dict) else set()
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _validate_group(group)
            for p in group["params"]:
                if torch.is_complex(p):
                    raise ValueError("AdamWFp8 does not support complex parameters")
                if not p.is_floating_point():
                    raise ValueError(f"AdamWFp8 needs floating-point parameters, got {p.dtype}")
        except ValueError:
            self.param_groups.pop()
            raise
        self._record_format(group)
        explicit = (given & set(RESUMED_OPTIONS)) | self._passed
        self._explicit[id(group)] = (group, {k: group[k] for k in RESUMED_OPTIONS if k in explicit})

    def _record_format(self, group: dict[str, Any]) -> None:
        """Remember the format options ``group``'s moments are (or will be) stored with."""
        self._formats[id(group)] = (
            group,
            {k: group[k] for k in (*FORMAT_OPTIONS, "moment_format")},
        )

    def _check_formats(self) -> None:
        """Raise when a format option of a live param group was changed while its parameters
        hold quantized moments written with the old one (R29 finding 3): they would be decoded
        as another format. A group without such moments takes the new options."""
        groups = self.param_groups
        if len(self._formats) > len(groups):  # groups replaced: forget the old ones
            live = {id(g) for g in groups}
            self._formats = {k: v for k, v in self._formats.items() if k in live}
        for i, group in enumerate(groups):
            record = self._formats.get(id(group))
            if record is None or record[0] is not group:
                self._record_format(group)
                continue
            difference = format_difference(record[1], group)
            if difference is None:
                continue
            if not any(
                is_quantized_state(self.state[p]) for p in group["params"] if p in self.state
            ):
                self._record_format(group)
                continue
            option, old, new = difference
            raise ValueError(
                f"AdamWFp8: param group {i} has {option}={new!r}, but the moments stored for its "
                f"parameters use {option}={old!r} (a format option was changed in a live param "
                f"group); nothing was updated. Set optimizer.param_groups[{i}][{option!r}] back "
                f"to {old!r}, or move the moments to the new format: load "
                "optimizer.torch_state_dict() (fp32 moments) into a new AdamWFp8 created with "
                f"{option}={new!r}, or drop the states of this group's parameters "
                "(optimizer.state.pop(p)) to restart their moments"
            )

    # ------------------------------------------------------------------ step
    @torch.compiler.disable(reason=_NOT_COMPILED)
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Ctrl-C (SIGINT) and SIGTERM handlers run after the step, never inside it: the step is
        # applied whole or not at all (see _deferred_signals).
        with _deferred_signals():
            self._step()
        return loss

    def _step(self) -> None:
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._check_step(index)  # refuses before any weight or state changes, like torch
        # Every kernel launch of the step (all groups, one batch) runs before any eager update:
        # a launch the kernel refuses (out of memory) then leaves everything as it was.
        batch = _cpu_kernel.Batch()
        stepped: list[dict[str, Any]] = []  # states whose step count this call advanced
        fresh: list[torch.Tensor] = []  # parameters whose state this call created
        kernel: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, what the kernel writes)
        try:
            plans = [
                self._plan_group(g, index, batch, stepped, fresh, kernel) for g in self.param_groups
            ]
            batch.run()  # the launch only: copies back are ours (below)
        except BaseException as err:  # KeyboardInterrupt too: nothing half-counted
            if getattr(err, "applied", False):
                _bump_versions(kernel)
            else:  # nothing touched: the step can be retaken
                for state in stepped:
                    state["step"] -= 1
                for p in fresh:
                    del self.state[p]
            raise
        # From here on weights have moved: an error is never rolled back (the states of the
        # parameters the kernel updated must stay with their weights; R29 finding 4).
        try:
            _bump_versions(kernel)  # raw-pointer writes: autograd must see them (R29 finding 1)
            for param, work in kernel:
                if work is not param:
                    param.copy_(work)
            for group, eager, fp32 in plans:
                for run in eager:
                    run()
                self._fp32_steps(group, fp32)
        except BaseException as err:
            err.add_note(
                "AdamWFp8: this step was partly applied (the C kernel had already updated "
                f"{len(kernel)} parameter(s) and their states); restore a checkpoint rather "
                "than retry the step"
            )
            raise

    def _check_step(self, index: dict[torch.Tensor, int]) -> None:
        """Raise now, before anything changes, on a sparse gradient or on parameters that share
        memory. (A tensor ``implementation="cpu_kernel"`` cannot take is refused while the
        step is planned, which changes nothing either: see :meth:`step`.)"""
        stepping = []
        names: dict[torch.Tensor, str] = {}
        for i, group in enumerate(self.param_groups):
            names.update(zip(group["params"], group.get("param_names", ()), strict=False))
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        f"AdamWFp8 does not support sparse gradients (parameter {index[p]}, "
                        f"param group {i}); nothing was updated. Use torch.optim.SparseAdam "
                        "for sparse parameters (e.g. nn.Embedding(sparse=True))"
                    )
                if p.grad is not None:
                    stepping.append(p)
        _check_no_shared_memory(stepping, index, names)
        self._check_formats()

    def _plan_group(
        self,
        group: dict[str, Any],
        index: dict[torch.Tensor, int],
        batch: _cpu_kernel.Batch,
        stepped: list[dict[str, Any]],
        fresh: list[torch.Tensor],
        kernel: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[dict[str, Any], list[Callable[[], None]], dict]:
        """Advance the step counts of ``group``, queue its kernel steps on ``batch`` (and
        ``(param, tensor the kernel writes)`` on ``kernel``); returns ``(group, eager quantized
        steps, fp32 lists)`` to run after the batch. Changes no weight or moment."""
        # per device and dtype, as torch's foreach groups (float64 weights step in float64)
        fp32: dict[tuple[torch.device, torch.dtype], dict[str, list]] = {}
        eager: list[Callable[[], None]] = []
        hp_cache: dict[tuple[float, torch.device, torch.dtype], torch.Tensor] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                fresh.append(p)
                self._init_state(p, state, group)
            state["step"] += 1
            stepped.append(state)
            step = float(state["step"])
            if not is_quantized_state(state):
                lists = fp32.setdefault(
                    (p.device, p.dtype), {"p": [], "g": [], "m": [], "v": [], "s": []}
                )
                for key, value in zip(
                    "pgmvs", (p, p.grad, state["exp_avg"], state["exp_avg_sq"], step), strict=True
                ):
                    lists[key].append(local(value) if key != "s" else value)
                continue
            param, grad = local(p), local(p.grad)
            if param.numel() == 0:
                continue
            states = tuple(None if s is None else local(s) for s in quantized_states(state))
            key = (step, param.device, _step.hp_dtype(param.dtype))
            if key not in hp_cache:
                hp_cache[key] = _step.hyperparams(group, *key)
            keys = _stream_keys(group, int(step), index[p], p, states[0].shape[1])
            run = self._quantized_step(
                param, grad, states, hp_cache[key], group, batch, keys, kernel
            )
            if run is not None:
                eager.append(run)
        return group, eager, fp32

    def _fp32_steps(self, group: dict[str, Any], fp32: dict) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        for lists in fp32.values():
            _step.fp32_step(
                lists["p"],
                lists["g"],
                lists["m"],
                lists["v"],
                lists["s"],
                lr=float(lr) if isinstance(lr, torch.Tensor) else lr,  # host sync on GPU
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
            )

    def _quantized_step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: tuple[torch.Tensor | None, ...],
        hp: torch.Tensor,
        group: dict[str, Any],
        batch: _cpu_kernel.Batch,
        keys: tuple[int, int],
        kernel: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> Callable[[], None] | None:
        """Queue the kernel step of ``param`` on ``batch`` (and ``(param, work)`` on ``kernel``:
        the caller copies ``work`` back), or return the eager step to run after the batch
        (reference / compile)."""
        rows = param.shape[0]
        cols = param.numel() // rows
        gs = group["group_size"]
        expand = group["dynamic_range_expansion"]
        options = step_options(group)
        work = param if param.is_contiguous() else param.contiguous()
        impl = self._resolve(work, grad, states, states[0].dtype, expand, options)
        if impl == "cpu_kernel":  # queued: one kernel call per group and variant
            batch.add(work, grad, states, hp, cols, gs, expand, keys=keys, **options)
            kernel.append((param, work))
            return None
        if options["sr_m"] or options["sr_v"]:
            options["keys"] = torch.tensor(keys, dtype=torch.int64, device=param.device)

        def run() -> None:
            p2d, g2d = work.view(rows, cols), grad.reshape(rows, cols)
            done = False
            if impl == "compile" and self.implementation != "reference":
                try:
                    fn = self._compiled_fn()
                    _step.run_grouped(fn, p2d, g2d, states, hp, gs, True, **options)
                    done = True
                except Exception as exc:  # compilation failed: reference from now on
                    why = f"torch.compile failed ({exc!r}); using the reference"
                    self._warn_once("compile", why)
                    self.implementation = "reference"
            if not done:
                _step.run_grouped(_step.grouped_step, p2d, g2d, states, hp, gs, **options)
            if work is not param:
                param.copy_(work)

        return run

    def _resolve(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: tuple,
        code_dtype: torch.dtype,
        expand: bool,
        options: dict[str, bool],
    ) -> str:
        impl = self.implementation
        if impl in ("auto", "cpu_kernel"):
            why = None
            if not _cpu_kernel.supports(param, grad, states):
                why = (
                    f"it handles contiguous fp32/bf16 CPU tensors, got {param.dtype} on "
                    f"{param.device.type} with a {grad.dtype} gradient"
                )
            else:
                variant = _cpu_kernel.variant(
                    param.dtype, grad.dtype, code_dtype, expand, **options
                )
                if _cpu_kernel.load(variant):
                    return "cpu_kernel"
                why = _cpu_kernel.error(variant)
                if impl == "auto":
                    self._warn_once("kernel", f"CPU kernel unavailable ({why})")
            if impl == "cpu_kernel":  # asked for explicitly: never fall back silently
                raise RuntimeError(
                    f"AdamWFp8(implementation='cpu_kernel'): the C kernel cannot run ({why}); "
                    "nothing was updated. Use implementation='auto' to fall back to "
                    "torch.compile / the reference"
                )
        if impl == "reference" or (impl == "auto" and not compile_enabled()):
            return "reference"  # HF_FP8_COMPILE=0: no inductor, as for the FP8 layers
        return "compile"

    def _compiled_fn(self) -> Callable:
        if self._compiled is None:
            self._compiled = torch.compile(_step.grouped_step, fullgraph=True, dynamic=False)
        return self._compiled

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"AdamWFp8: {message}", RuntimeWarning, stacklevel=3)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        quantize = wants_quantized(p, group)
        if quantize and not quantizable_placements(p):
            self._warn_once(
                "placements",
                f"DTensor parameters with placements {p.placements} keep fp32 states: groups "
                "follow rows, so only Shard(0) and Replicate placements are quantized",
            )
            quantize = False
        if quantize:
            state.update(
                new_quantized_state(
                    p,
                    group_size=group["group_size"],
                    fp8=fp8_dtype(group["fp8_format"]),
                    expand=group["dynamic_range_expansion"],
                    log=resolved_format(group) == "log",
                )
            )
        else:
            state.update(new_fp32_state(p))

    @torch.no_grad()
    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(exp_avg, exp_avg_sq)`` of ``p`` (its local shard), dequantized if stored in FP8
        (``exp_avg_sq`` is squared back when stored as its root)."""
        state = self.state[p]
        loc = local(p)
        if not is_quantized_state(state):
            return local(state["exp_avg"]).float(), local(state["exp_avg_sq"]).float()
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        rows = loc.shape[0]
        cols = loc.numel() // max(rows, 1)

        def unpad(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(rows, -1)[:, :cols].reshape(loc.shape)

        if resolved_format(group) == "log":
            vs = local(state["exp_avg_sq_scale"])
            vq = local(state["exp_avg_sq_fp8"]).view(rows, vs.shape[1], -1)
            vk = local(state["exp_avg_sq_exponent"])
            v_bits = log_moments.dequantize_v_bits(vq, vs, vk)
            ms = local(state["exp_avg_scale"])
            mq = local(state["exp_avg_fp8"]).view(rows, ms.shape[1], -1)
            m = log_moments.dequantize_m(mq, ms, log_moments.m_scales(vq, vs, vk)[0])
            return unpad(m), unpad(v_bits.view(torch.float32))
        out = []
        for name in ("exp_avg", "exp_avg_sq"):
            scale = local(state[f"{name}_scale"])
            exp = state.get(f"{name}_exponent")
            q = local(state[f"{name}_fp8"]).view(rows, scale.shape[1], -1)
            x = coat.dequantize_groups(q, scale, None if exp is None else local(exp))
            out.append(unpad(x))
        m, v = out
        return m, v * v if group["sqrt_second_moment"] else v

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()``; every param group also records the state
        format (:data:`STATE_FORMAT_KEY`: :data:`STATE_FORMAT`), which
        :meth:`load_state_dict` checks."""
        sd = super().state_dict()
        sd["param_groups"] = [{**g, STATE_FORMAT_KEY: STATE_FORMAT} for g in sd["param_groups"]]
        return sd

    @torch.no_grad()
    def torch_state_dict(self) -> dict[str, Any]:
        """A state ``torch.optim.AdamW.load_state_dict`` takes and steps from (R29 finding 6).

        Per parameter ``step`` (as torch stores it: an fp32 scalar tensor) and fp32
        ``exp_avg`` / ``exp_avg_sq`` decoded from the stored codes (:meth:`moments`; fp32
        states are copied); param groups without AdamWFp8's own options
        (:data:`OWN_OPTIONS`), with torch.optim.AdamW's flags (``amsgrad=False``,
        ``decoupled_weight_decay=True``, ...), every other key kept (a scheduler's
        ``initial_lr``). Loaded into an :class:`AdamWFp8`, the moments are quantized in that
        optimizer's format: the way to change the format of a run's moments. New tensors: the
        optimizer is not changed. (``state_dict()`` itself holds the codes, which
        torch.optim.AdamW accepts but cannot step from: ``KeyError: 'exp_avg'``.)"""
        sd = super().state_dict()
        flags = {
            k: v
            for k, v in torch.optim.AdamW([torch.zeros(1)]).defaults.items()
            if k not in ("lr", "betas", "eps", "weight_decay")
        }
        groups = [
            {**flags, **{k: v for k, v in g.items() if k not in (*OWN_OPTIONS, STATE_FORMAT_KEY)}}
            for g in sd["param_groups"]
        ]
        params = [p for g in self.param_groups for p in g["params"]]
        state: dict[Any, dict[str, Any]] = {}
        for pid, st in sd["state"].items():
            p = params[pid]
            if not st:
                state[pid] = {}
                continue
            if is_quantized_state(st):
                m, v = self.moments(p)
                if is_dtensor(p):  # moments() gives the local shard
                    m, v = (_like_dtensor(t, p) for t in (m, v))
            else:
                m, v = (
                    st[k].detach().to(torch.float32, copy=True) for k in ("exp_avg", "exp_avg_sq")
                )
            step = st["step"]
            step = (
                step.detach().clone()
                if isinstance(step, torch.Tensor)
                else torch.tensor(float(step))
            )
            state[pid] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state after checking every tensor against its parameter.

        FP8 codes and fp32 metadata keep their dtypes (only the device moves). Raises
        ``ValueError`` when the state was saved with another ``group_size``, ``fp8_format``
        or ``dynamic_range_expansion``, and :class:`OptimizerStateError` (a ``ValueError``)
        when a tensor does not fit its parameter (shape, dtype, range) — before anything is
        changed. A ``torch.optim.AdamW`` state is accepted: its fp32 moments become FP8 for
        the parameters this optimizer quantizes. Saved param-group keys are kept, as in
        ``torch.optim`` (a scheduler's ``initial_lr``), except torch's own flags
        (:data:`TORCH_ONLY_KEYS`). Load-state-dict pre- and post-hooks run on the real state,
        as in ``torch.optim.Optimizer``.
        """
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        _check_structure(state_dict)
        groups = self._merged_groups(state_dict["param_groups"])
        params: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
        for saved, group, merged in zip(
            state_dict["param_groups"], self.param_groups, groups, strict=True
        ):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"a loaded parameter group has {len(saved['params'])} parameters, this "
                    f"optimizer's has {len(group['params'])}. {GROUP_MISMATCH_FIX}."
                )
            for pid, p in zip(saved["params"], group["params"], strict=True):
                params[pid] = (p, merged)
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        converted = 0
        for pid, saved_state in state_dict["state"].items():
            if pid not in params:
                raise OptimizerStateError(
                    f"optimizer state names parameter {pid!r}, which no parameter group lists "
                    f"(they list {list(params)[:8]}{' ...' if len(params) > 8 else ''}). "
                    f"{_DAMAGED}"
                )
            p, group = params[pid]
            new_state[p], was_converted = validated_state(saved_state, p, group, pid)
            converted += was_converted
        if converted:
            self._warn_once(
                "converted",
                f"converted the fp32 moments of {converted} parameter(s) to FP8 states",
            )
        replaced = self._replaced_options(groups)
        if replaced:
            self._warn_once("replaced_options", replaced)
        # Everything is valid: install it. The base class sets the param groups (its hooks
        # are detached: they run here, once, on the real state).
        pre, post = (
            self._optimizer_load_state_dict_pre_hooks,
            self._optimizer_load_state_dict_post_hooks,
        )
        self._optimizer_load_state_dict_pre_hooks = type(pre)()
        self._optimizer_load_state_dict_post_hooks = type(post)()
        old_groups = list(self.param_groups)
        try:
            super().load_state_dict({"state": {}, "param_groups": groups})
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
        for p, st in new_state.items():
            self.state[p] = st
        for group in self.param_groups:  # the loaded moments are in these groups' formats
            self._record_format(group)
        # what the user set stays with the new groups (accelerate's AcceleratedOptimizer loads
        # the optimizer's own state_dict() once before the Trainer loads optimizer.pt)
        explicit = [self._explicit.get(id(g)) for g in old_groups]
        self._explicit = {
            id(g): (g, record[1])
            for g, old, record in zip(self.param_groups, old_groups, explicit, strict=True)
            if record is not None and record[0] is old
        }
        for hook in post.values():
            hook(self)

    def _replaced_options(self, groups: list[dict[str, Any]]) -> str | None:
        """The warning (once) when a loaded group replaces a :data:`RESUMED_OPTIONS` value the
        user set (passed to the constructor or in a param group) with another one, or ``None``.
        The loaded value is kept, as torch.optim keeps a loaded ``lr`` / ``betas`` (R37
        finding 2)."""
        replaced: dict[str, list[int]] = {}  # "name=loaded (you set mine)" -> group indices
        for i, (group, new) in enumerate(zip(self.param_groups, groups, strict=True)):
            record = self._explicit.get(id(group))
            if record is None or record[0] is not group:
                continue
            for name, mine in record[1].items():
                if (new[name], type(new[name])) != (mine, type(mine)):
                    replaced.setdefault(f"{name}={new[name]!r} (you set {mine!r})", []).append(i)
        if not replaced:
            return None
        listed = "; ".join(
            f"{what} in param group{'s' if len(i) > 1 else ''} {', '.join(map(str, i))}"
            for what, i in replaced.items()
        )
        numel = any(what.startswith("min_quantize_numel=") for what in replaced)
        return (
            "the loaded state's options replace yours, as torch.optim's load_state_dict "
            f"replaces lr and betas: {listed}. To run with yours, set them after "
            "loading (optimizer.param_groups[i][name] = value; with transformers' Trainer in "
            "a TrainerCallback's on_train_begin, which runs after the checkpoint is loaded)"
            + (
                ". min_quantize_numel decides only when a state is created (8-bit or fp32): to "
                "store the loaded moments by yours, load the saving optimizer's "
                "torch_state_dict() instead (fp32 moments, stored on load by this optimizer's "
                "options)"
                if numel
                else ""
            )
        )

    def _merged_groups(self, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Saved groups over this optimizer's (a torch AdamW state lacks our options): every
        saved key is kept except :data:`TORCH_ONLY_KEYS`."""
        if not isinstance(saved_groups, (list, tuple)):
            raise ValueError(
                f"the loaded state's param_groups is a {type(saved_groups).__name__}, expected "
                f"a list of dicts (optimizer.state_dict()['param_groups']). {_DAMAGED}"
            )
        for i, saved in enumerate(saved_groups):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
                what = (
                    f"has no 'params' list (its keys: {sorted(map(str, saved))})"
                    if isinstance(saved, dict)
                    else f"is a {type(saved).__name__}, expected a dict"
                )
                raise ValueError(f"loaded param group {i} {what}. {_DAMAGED}")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state has {len(saved_groups)} parameter groups, "
                f"this optimizer has {len(self.param_groups)}. {GROUP_MISMATCH_FIX}."
            )
        merged = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            version = saved.get(STATE_FORMAT_KEY, STATE_FORMAT)
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise ValueError(
                    f"loaded param group {i}: {STATE_FORMAT_KEY} must be an int >= 1, got "
                    f"{version!r}. {_DAMAGED}"
                )
            if version > STATE_FORMAT:
                raise ValueError(
                    f"loaded param group {i} holds an AdamWFp8 state of format {version}, "
                    f"written by a newer hf_fp8 (this one reads format {STATE_FORMAT}): "
                    "upgrade hf_fp8 to resume from it"
                )
            if "betas" not in saved:  # every Adam / AdamW / AdamWFp8 group has them
                keys = sorted(str(k) for k in saved if k != "params")
                raise ValueError(
                    f"loaded param group {i} has no 'betas' (its keys: {keys}): the state looks "
                    "like another optimizer's (SGD, Adafactor, RMSprop, ...), not "
                    "torch.optim.AdamW's or AdamWFp8's. Resume it with the optimizer that saved "
                    f"it, or {RESTART_FIX}."
                )
            if "group_size" in saved:  # an AdamWFp8 state from before an option existed
                saved = {"sqrt_second_moment": False, "moment_format": "fp8", **saved}
            # Like torch.optim: every saved key is kept (schedulers' initial_lr, user keys),
            # options the saved group lacks stay this optimizer's; torch-only flags go.
            new = {k: v for k, v in group.items() if k != "params"}
            new.update(
                {k: v for k, v in saved.items() if k not in (*TORCH_ONLY_KEYS, STATE_FORMAT_KEY)}
            )
            try:  # the saved values first: a damaged one is never read as a format to create
                _validate_group(new)
            except ValueError as exc:
                raise ValueError(f"loaded param group {i}: {exc}. {GROUP_MISMATCH_FIX}.") from exc
            differences = format_differences(saved, group)
            if differences:
                raise ValueError(_format_mismatch(i, saved, differences))
            for option in ("amsgrad", "maximize"):
                if saved.get(option):
                    raise ValueError(
                        f"loaded param group {i} uses {option}=True, which AdamWFp8 does not "
                        "support"
                    )
            if saved.get("decoupled_weight_decay") is False and saved.get("weight_decay"):
                raise ValueError(
                    f"loaded param group {i} is torch.optim.Adam's (decoupled_weight_decay="
                    f"False, weight_decay={saved['weight_decay']!r}: L2 decay added to the "
                    "gradient); AdamWFp8 decays the weights decoupled, like AdamW. Load it into "
                    "torch.optim.Adam, or set weight_decay=0 in the saved group to drop the decay"
                )
            merged.append(new)
        return merged


@contextlib.contextmanager
def _deferred_signals() -> Iterator[None]:
    """Hold the Python handlers of SIGINT and SIGTERM while the block runs; call them after it.

    A handler runs between two bytecodes of the main thread: Ctrl-C's ``KeyboardInterrupt``
    raised as the C kernel's call returned left its weights updated and the other parameters
    counted but not stepped. Held here, the step completes, then each signal's own handler runs
    (``KeyboardInterrupt`` is raised after the step). A second signal of the same kind while one
    is held runs its handler at once (an impatient second Ctrl-C still interrupts a long first
    ``torch.compile``; that step may then be half-applied). Only the main thread can set
    handlers: elsewhere, and for signals without a Python handler, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: dict[int, Any] = {}  # signal -> its handler, while this block holds it
    pending: list[tuple[int, Any]] = []

    def hold(signum: int, frame: Any) -> None:
        if signum in held and any(s == signum for s, _ in pending):  # a second one: at once
            handler = held.pop(signum)
            signal.signal(signum, handler)
            handler(signum, frame)
            return
        pending.append((signum, frame))

    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):
                signal.signal(signum, hold)
                held[signum] = handler
    except ValueError:  # not the main interpreter's main thread
        pass
    try:
        yield
    finally:
        for signum, handler in held.items():
            if signal.getsignal(signum) is hold:  # not replaced meanwhile
                signal.signal(signum, handler)
        for signum, frame in pending:
            handler = held.get(signum)
            if callable(handler):
                handler(signum, frame)


class _Fp8Codes(NamedTuple):
    """fp8 moment codes as pickled by :meth:`AdamWFp8.__getstate__`: their uint8 bytes and the
    fp8 dtype's name."""

    codes: torch.Tensor
    dtype: str


FP8_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


def _codes_as_bytes(state: dict[Any, dict[str, Any]]) -> defaultdict:
    """A copy of the per-parameter states with every (plain) fp8 tensor as :class:`_Fp8Codes`."""
    out: defaultdict = defaultdict(dict)
    for p, st in state.items():
        out[p] = {
            k: _Fp8Codes(v.view(torch.uint8), str(v.dtype).removeprefix("torch."))
            if type(v) is torch.Tensor and v.dtype in FP8_DTYPES.values()
            else v
            for k, v in st.items()
        }
    return out


def _codes_from_bytes(state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """``state`` with every :class:`_Fp8Codes` back as its fp8 tensor (in place)."""
    for st in state.values():
        if not isinstance(st, dict):
            continue
        for k, v in st.items():
            if isinstance(v, _Fp8Codes):
                if v.dtype not in FP8_DTYPES or v.codes.dtype != torch.uint8:
                    raise ValueError(f"pickled AdamWFp8 state: {k!r} holds {v.dtype!r} codes")
                st[k] = v.codes.view(FP8_DTYPES[v.dtype])
    return state


# A loaded state that is no optimizer state_dict (R37 finding 4).
_DAMAGED = (
    "The loaded optimizer state is damaged or not an optimizer's state_dict() (with "
    "transformers' Trainer: the checkpoint's optimizer.pt). Load the state_dict() of an "
    f"AdamWFp8 or a torch.optim.AdamW, or {RESTART_FIX}"
)


def _check_structure(state_dict: Any) -> None:
    """``state_dict`` is a dict with a ``state`` dict and a ``param_groups`` list (torch reads
    them with a raw ``KeyError`` / ``AttributeError``; the groups are checked in
    :meth:`AdamWFp8._merged_groups`)."""
    if not isinstance(state_dict, dict):
        raise ValueError(
            f"a loaded optimizer state must be a dict with 'state' and 'param_groups', got a "
            f"{type(state_dict).__name__}. {_DAMAGED}"
        )
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise ValueError(
                f"the loaded optimizer state has no {key!r} entry (its keys: "
                f"{sorted(map(str, state_dict))}). {_DAMAGED}"
            )
    if not isinstance(state_dict["state"], dict):
        raise ValueError(
            f"the loaded optimizer state's 'state' is a {type(state_dict['state']).__name__}, "
            f"expected a dict of parameter index -> state. {_DAMAGED}"
        )


def _option_text(option: str, value: Any, *, trainer: bool = False) -> str:
    """``option=value`` as a keyword argument, or as an ``optim_args`` item."""
    if not trainer:
        return f"{option}={value!r}"
    return f"{option}={str(value).lower() if isinstance(value, bool) else value}"


def _format_mismatch(i: int, saved: dict[str, Any], differences: list) -> str:
    """The error for a saved state of another format (R37 finding 5): the options to create
    the optimizer with, also as Trainer arguments, the conversion and the restart."""
    theirs = ", ".join(_option_text(o, t) for o, t, _ in differences)
    mine = ", ".join(_option_text(o, m) for o, _, m in differences)
    optim = TRAINER_NAMES[bool(saved.get("dynamic_range_expansion", True))]
    args = ",".join(
        _option_text(o, t, trainer=True)
        for o, t, _ in differences
        if o != "dynamic_range_expansion"
    )
    trainer = f'optim="{optim}"' + (f', optim_args="{args}"' if args else "")
    return (
        f"cannot load an AdamWFp8 state saved with {theirs} into param group {i} configured "
        f"with {mine}; create the optimizer with {theirs} (with transformers' Trainer: "
        f"{trainer}), or convert the moments: load this state into an AdamWFp8 created with "
        "the saved options and load that optimizer's torch_state_dict() here instead (fp32 "
        "moments, quantized on load in this optimizer's format; for a Trainer checkpoint: "
        "torch.save(that_optimizer.torch_state_dict(), 'checkpoint-N/optimizer.pt')), or "
        f"{RESTART_FIX}"
    )


def format_differences(saved: dict[str, Any], group: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every ``(option, saved value, group value)`` of :func:`format_difference`, in order."""
    out = [(o, saved[o], group[o]) for o in FORMAT_OPTIONS if o in saved and saved[o] != group[o]]
    if "group_size" in saved:
        mine, theirs = resolved_format(group), resolved_format({**group, **saved})
        if theirs != mine:
            out.append(("moment_format", theirs, mine))
    return out


def format_difference(saved: dict[str, Any], group: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first format option in which moments stored under ``saved``'s options cannot be read
    by ``group``: ``(option, saved value, group value)``, or ``None``.

    Compares :data:`FORMAT_OPTIONS` that ``saved`` has, then (for an AdamWFp8 group, one with
    ``group_size``) the resolved moment format (``"auto"`` and what it stands for are the same
    format; ``moment_format`` itself is reported as the resolved formats). Used when a state is
    loaded and at every step against the options the group's moments were stored with."""
    for option in FORMAT_OPTIONS:
        if option in saved and saved[option] != group[option]:
            return option, saved[option], group[option]
    if "group_size" in saved:
        mine, theirs = resolved_format(group), resolved_format({**group, **saved})
        if theirs != mine:
            return "moment_format", theirs, mine
    return None


# torch.optim.AdamW flags taken where they change nothing: name -> (accepted values, fix)
TORCH_FLAGS = {
    "foreach": ((None, False, True), "foreach only picks torch's implementation"),
    "fused": (
        (None, False),
        "AdamWFp8's step is already fused: the C kernel on the CPU (implementation='auto' or "
        "'cpu_kernel'), torch.compile elsewhere; pass fused=None, or use "
        "torch.optim.AdamW(fused=True) for fp32 moments",
    ),
    "maximize": (
        (False,),
        "negate the loss (or the gradients) instead, or use torch.optim.AdamW(maximize=True)",
    ),
    "capturable": (
        (False,),
        "AdamWFp8 steps cannot be captured in CUDA graphs; use torch.optim.AdamW(capturable=True)",
    ),
    "differentiable": (
        (False,),
        "AdamWFp8 steps are not differentiable; use torch.optim.AdamW(differentiable=True)",
    ),
}


def _check_torch_flags(**flags: Any) -> None:
    """Accept torch.optim.AdamW's flags at the values that change nothing (R29 finding 7)."""
    for name, value in flags.items():
        accepted, fix = TORCH_FLAGS[name]
        if not any(value is a for a in accepted):
            names = ", ".join(repr(a) for a in accepted[:-1])
            names = f"{names} or {accepted[-1]!r}" if names else repr(accepted[-1])
            raise ValueError(
                f"AdamWFp8 does not support {name}={value!r} (it takes {name}={names}): {fix}"
            )


def _like_dtensor(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The local shard ``t`` of a tensor laid out as the DTensor ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _bump_versions(kernel: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Bump the autograd version of every tensor the C kernel wrote in place (it writes
    through raw pointers): a graph that saved the old weight then refuses a second backward,
    as after ``torch.optim.AdamW``'s in-place update. Copies back bump theirs in ``copy_``."""
    written = [param for param, work in kernel if work is param]
    if written:
        torch.autograd.graph.increment_version(written)


def _check_no_shared_memory(
    params: list[torch.Tensor], index: dict[torch.Tensor, int], names: dict[torch.Tensor, str]
) -> None:
    """Refuse parameters that overlap themselves (expanded, stride 0) or each other (two
    ``Parameter`` objects over the same memory, e.g. ``Parameter(w.t())`` next to ``w``).

    ``torch.optim.AdamW`` steps such aliases one after the other; here the C kernel would race
    on the shared memory, and a transposed alias stepped in a contiguous copy would write a
    stale copy back over the other's update (R29 finding 2). The byte ranges are compared per
    storage (conservative: interleaved views of one buffer count as sharing)."""

    def label(p: torch.Tensor) -> str:
        name = f" {names[p]!r}" if p in names else ""
        return f"parameter {index[p]}{name} (shape {tuple(p.shape)})"

    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            raise ValueError(
                f"AdamWFp8: {label(p)} appears more than once in the optimizer's param groups "
                "(torch.optim warns that duplicate parameters are deprecated and will be an "
                "error); nothing was updated. List each parameter once, e.g. "
                "list(dict.fromkeys(params))"
            )
        seen.add(id(p))
    spans: dict[tuple[torch.device, int], list[tuple[int, int, torch.Tensor]]] = {}
    plain = (torch.Tensor, torch.nn.Parameter)
    for p in params:
        t = p if type(p) in plain else local(p)
        n = t.numel()
        if n == 0 or t.device.type == "meta":
            continue
        size = t.element_size()
        start = t.storage_offset() * size
        if t.is_contiguous():  # the common case: no overlap within, n elements from start
            end = start + n * size
        else:
            if torch._debug_has_internal_overlap(t) == 1:
                raise ValueError(
                    f"AdamWFp8: {label(p)}, with strides {tuple(t.stride())}, has elements "
                    "that overlap in memory (an expanded or stride-0 tensor); nothing was "
                    "updated. Make it a real tensor: torch.nn.Parameter(t.contiguous()) (or "
                    ".clone())"
                )
            last = sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))
            end = start + (last + 1) * size
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((start, end, p))
    for items in spans.values():
        if len(items) < 2:
            continue
        items.sort(key=lambda item: item[0])
        reach, holder = items[0][1], items[0][2]
        for start, end, p in items[1:]:
            if start < reach:
                first, second = sorted((holder, p), key=lambda q: index[q])
                raise ValueError(
                    f"AdamWFp8: {label(first)} and {label(second)} share memory (views of one "
                    "tensor, e.g. a weight tied as torch.nn.Parameter(w.t()); non-contiguous "
                    "views of one buffer count by their whole span) and both have a "
                    "gradient; nothing was updated. Tie them as one Parameter (assign the same "
                    "Parameter object to both modules and transpose in the forward), or give "
                    "one its own memory with torch.nn.Parameter(t.detach().clone())"
                )
            if end > reach:
                reach, holder = end, p


def step_options(group: dict[str, Any]) -> dict[str, bool]:
    """The per-group options of the quantized step (flags of the C kernel)."""
    sr = group["stochastic_rounding"]
    return {
        "sqrt_v": bool(group["sqrt_second_moment"]),
        "sr_m": sr is True,
        "sr_v": bool(sr),
        "log": resolved_format(group) == "log",
    }


def _stream_keys(
    group: dict[str, Any], step: int, index: int, p: torch.Tensor, padded_cols: int
) -> tuple[int, int]:
    """uint32 stochastic-rounding keys of both moments of ``p``'s local rows at ``step``."""
    if not group["stochastic_rounding"]:
        return (0, 0)
    first = row_offset(p) * padded_cols  # a shard's first element in the full state
    if resolved_format(group) == "log":  # thresholds low-discrepancy in time (time_key)
        return tuple(  # type: ignore[return-value]
            (log_moments.time_key(coat.stream_key(group["seed"], 0, index, moment), step) + first)
            & coat.MASK32
            for moment in (0, 1)
        )
    return tuple(  # type: ignore[return-value]
        (coat.stream_key(group["seed"], step, index, moment) + first) & coat.MASK32
        for moment in (0, 1)
    )


def _is_number(x: Any) -> bool:
    """A real number, or a tensor of one real element (as ``torch.optim.AdamW`` takes)."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not x.is_complex()
    return isinstance(x, numbers.Real)


def _validate_group(group: dict[str, Any]) -> None:
    """Check ``group``'s options (raises ``ValueError``); 0-d tensor betas become floats (the
    step's arithmetic takes Python numbers), a tensor ``lr`` stays a tensor. The types first:
    a foreign value (Adafactor's ``eps`` pair, ``lr=None``) raises ``ValueError`` naming the
    option, never a raw ``TypeError`` (R37 finding 1)."""
    for name in ("lr", "eps", "weight_decay"):
        if not _is_number(group[name]):
            raise ValueError(
                f"{name} must be a number or a tensor of exactly one element, got {group[name]!r}"
            )
    betas = group["betas"]
    pair = betas.tolist() if isinstance(betas, torch.Tensor) and betas.dim() == 1 else betas
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(map(_is_number, pair)):
        raise ValueError(f"betas must be a pair of numbers (beta1, beta2), got {betas!r}")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("a tensor lr must have exactly one element")
    if not float(lr) >= 0.0:  # a tensor lr too (NaN / negative), as torch.optim.AdamW
        raise ValueError(f"invalid learning rate: {lr}")
    if not group["eps"] >= 0.0:
        raise ValueError(f"invalid eps: {group['eps']}")
    betas = group["betas"]
    if isinstance(betas, (tuple, list)) and any(isinstance(b, torch.Tensor) for b in betas):
        if not all(not isinstance(b, torch.Tensor) or b.numel() == 1 for b in betas):
            raise ValueError(f"invalid betas: {betas} (tensor betas must have one element)")
        betas = group["betas"] = tuple(float(b) for b in betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas: {betas} (each must be in [0, 1))")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"invalid weight_decay: {group['weight_decay']}")
    gs = group["group_size"]
    if isinstance(gs, bool) or not isinstance(gs, int) or not 1 <= gs <= 65536:
        raise ValueError(f"group_size must be an int in [1, 65536], got {gs!r}")
    fp8_dtype(group["fp8_format"])  # raises with the accepted names
    if not isinstance(group["dynamic_range_expansion"], bool):
        raise ValueError("dynamic_range_expansion must be a bool")
    if group["stochastic_rounding"] not in STOCHASTIC_ROUNDING or (
        not isinstance(group["stochastic_rounding"], (bool, str))
    ):
        raise ValueError(
            f"stochastic_rounding must be one of {STOCHASTIC_ROUNDING}, "
            f"got {group['stochastic_rounding']!r}"
        )
    if not isinstance(group["sqrt_second_moment"], bool):
        raise ValueError("sqrt_second_moment must be a bool")
    fmt = group["moment_format"]
    if not isinstance(fmt, str) or fmt not in MOMENT_FORMATS:
        raise ValueError(f"moment_format must be one of {MOMENT_FORMATS}, got {fmt!r}")
    if fmt == "log":
        conflicts = [
            f"{name}={group[name]!r}"
            for name, ok in (
                ("dynamic_range_expansion", group["dynamic_range_expansion"]),
                ("fp8_format", group["fp8_format"] == "e4m3"),
                ("sqrt_second_moment", not group["sqrt_second_moment"]),
            )
            if not ok
        ]
        if conflicts:
            raise ValueError(
                f"moment_format='log' has its own codes and always expands v; "
                f"{', '.join(conflicts)} applies to moment_format='fp8' only: pass "
                "moment_format='fp8' (or 'auto')"
            )
    seed = group["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    n = group["min_quantize_numel"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"min_quantize_numel must be an int >= 0, got {n!r}")
