"""The one FP8 vocabulary and the one typed, frozen description of a scheme.

Every word hf_fp8 accepts for a scheme is a member of one of the enums below, and the
valid combinations (with their defaults) are one table, :data:`ACTIVATION_GRANULARITY_TABLE`.
Everything else derives from them: ``Fp8Config``'s validation, ``Fp8Linear``, the kernels'
plan, the numerics' scale layouts, the CLI choices, the serialization tables, the model card.
Adding a granularity or a scheme means editing this file and its kernel.

A user writes strings (``Fp8Config("dynamic", weight_granularity="row")``); they are resolved
once into an :class:`Fp8Recipe` (``Fp8Recipe.resolve(...)``) whose errors name the accepted
values. The enums are ``str`` subclasses: ``recipe.activation_scheme == "dynamic"`` holds and
JSON writes the plain word.

Two granularity vocabularies exist on purpose, mapped in exactly one place
(:attr:`ActivationGranularity.layout`):

* :class:`Granularity` is the scale *layout* of a ``[..., rows, cols]`` tensor, the numerics'
  word (``"tensor"``, ``"row"``, ``"block"``). Weights use it directly (a weight row is an
  output channel).
* :class:`ActivationGranularity` is the user's word for activations: ``"token"`` (one scale per
  token, i.e. per row of the ``[tokens, K]`` activation), ``"tensor"``, ``"block"`` (1 × ``bk``).

This module imports nothing but the standard library: the CLI and the numerics read it freely.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, TypeVar

__all__ = [
    "ACTIVATION_GRANULARITY_TABLE",
    "DEFAULT_BLOCK_SIZE",
    "ActivationGranularity",
    "ActivationScheme",
    "Fp8Format",
    "Fp8Recipe",
    "Granularity",
    "Kernel",
    "WeightGranularity",
    "WeightScaleMethod",
    "parse",
    "values",
]


class _Word(StrEnum):
    """A vocabulary word: compares, hashes, formats, prints and serializes as its string
    value (``repr`` too, so ``f"{x!r}"`` in an error message reads ``'e4m3'``)."""

    def __repr__(self) -> str:
        return repr(self.value)


class ActivationScheme(_Word):
    """How activations are quantized."""

    DYNAMIC = "dynamic"  # scale computed per call
    STATIC = "static"  # scale given or calibrated (hf_fp8.calibrate), per tensor
    WEIGHT_ONLY = "weight_only"  # activations stay in high precision


class Granularity(_Word):
    """Scale layout of a ``[..., rows, cols]`` tensor (the numerics' word)."""

    TENSOR = "tensor"  # one scale, shape [1]
    ROW = "row"  # one scale per row, shape [..., rows, 1]
    BLOCK = "block"  # one scale per (bn × bk) tile, shape [..., ceil(rows/bn), ceil(cols/bk)]


WeightGranularity = Granularity
"""Weight scale layout: ``"row"`` is per output channel; ``"block"`` tiles ``block_size``."""


class ActivationGranularity(_Word):
    """Activation scale granularity, in the user's words."""

    TENSOR = "tensor"
    TOKEN = "token"
    BLOCK = "block"  # 1 × block_size[1] groups along K

    @property
    def layout(self) -> Granularity:
        """The numerics layout of this granularity (``"token"`` → ``"row"``): the one map."""
        return _ACTIVATION_LAYOUT[self]


_ACTIVATION_LAYOUT = {
    ActivationGranularity.TENSOR: Granularity.TENSOR,
    ActivationGranularity.TOKEN: Granularity.ROW,
    ActivationGranularity.BLOCK: Granularity.BLOCK,
}


class Fp8Format(_Word):
    """FP8 storage format (torch dtypes in ``hf_fp8.numerics.formats.FP8_DTYPES``)."""

    E4M3 = "e4m3"  # torch.float8_e4m3fn, max 448
    E5M2 = "e5m2"  # torch.float8_e5m2, max 57344


class Kernel(_Word):
    """Which gemm runs an FP8 linear."""

    AUTO = "auto"  # torch._scaled_mm where the GPU and the scaling allow it, else emulated
    SCALED_MM = "scaled_mm"  # torch._scaled_mm or an error
    EMULATED = "emulated"  # dequantize + high-precision matmul (CPU, older GPUs)


class WeightScaleMethod(_Word):
    """How weight scales are chosen (same format on disk)."""

    ABSMAX = "absmax"  # amax / fp8_max
    MSE = "mse"  # per-group clipping that minimises the squared error


DEFAULT_BLOCK_SIZE: tuple[int, int] = (128, 128)

# The valid combinations: per activation scheme and weight granularity, the accepted
# activation granularities, the default first. An empty tuple: activations are not quantized
# (activation_granularity must be None).
ACTIVATION_GRANULARITY_TABLE: dict[
    ActivationScheme, dict[Granularity, tuple[ActivationGranularity, ...]]
] = {
    ActivationScheme.DYNAMIC: {
        Granularity.TENSOR: (
            ActivationGranularity.TOKEN,
            ActivationGranularity.TENSOR,
            ActivationGranularity.BLOCK,
        ),
        Granularity.ROW: (
            ActivationGranularity.TOKEN,
            ActivationGranularity.TENSOR,
            ActivationGranularity.BLOCK,
        ),
        Granularity.BLOCK: (
            ActivationGranularity.BLOCK,
            ActivationGranularity.TOKEN,
            ActivationGranularity.TENSOR,
        ),
    },
    # one calibrated scale per layer
    ActivationScheme.STATIC: dict.fromkeys(Granularity, (ActivationGranularity.TENSOR,)),
    ActivationScheme.WEIGHT_ONLY: dict.fromkeys(Granularity, ()),
}

E = TypeVar("E", bound=_Word)


@functools.lru_cache(maxsize=256)
def _resolve_cached(cls: type[Fp8Recipe], *words: Any) -> Fp8Recipe:
    return cls._resolve(*words)


def values(enum: type[_Word]) -> tuple[str, ...]:
    """The accepted words of ``enum``, in declaration order (for CLI ``choices`` and errors)."""
    return tuple(member.value for member in enum)


def parse(enum: type[E], value: Any, field: str) -> E:
    """``value`` (a word or a member) as a member of ``enum``; the error names the accepted words."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except (ValueError, TypeError):
        raise ValueError(f"{field}={value!r} is not supported; use one of {values(enum)}") from None


# The largest block side: a larger one means no more (one block covers any real matrix), and
# the C kernels take int64 sizes (2**64 + 32 would wrap to 32: R22 F1).
MAX_BLOCK = 2**31 - 1


def _block_size(block_size: Any) -> tuple[int, int]:
    """``block_size`` as ``(rows, cols)``: a list or tuple of two ints in [1, MAX_BLOCK].
    Floats, bools and strings are refused, not rounded or converted (``[32.7, 64]`` is an
    error)."""
    ok = (
        isinstance(block_size, (list, tuple))
        and len(block_size) == 2
        and all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) and 1 <= b <= MAX_BLOCK
            for b in block_size
        )
    )
    if not ok:
        raise ValueError(
            f"block_size must be two positive ints [rows, cols] of at most {MAX_BLOCK} (a list "
            f"or tuple of int, not float or bool), e.g. block_size=[128, 128]; got {block_size!r}"
        )
    return (int(block_size[0]), int(block_size[1]))


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 scheme, typed and validated: what every layer, kernel and file format reads.

    Build it with :meth:`resolve` (strings in, defaults filled in). Direct construction
    validates too, but ``activation_granularity`` must then be given (``None`` only for
    weight-only). Hashable and immutable: use :func:`dataclasses.replace` for a variant.
    """

    activation_scheme: ActivationScheme = ActivationScheme.DYNAMIC
    weight_granularity: Granularity = Granularity.ROW
    activation_granularity: ActivationGranularity | None = ActivationGranularity.TOKEN
    fp8_format: Fp8Format = Fp8Format.E4M3
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
    kernel: Kernel = Kernel.AUTO
    weight_scale_method: WeightScaleMethod = WeightScaleMethod.ABSMAX

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        scheme = parse(ActivationScheme, self.activation_scheme, "activation_scheme")
        weights = parse(Granularity, self.weight_granularity, "weight_granularity")
        put("activation_scheme", scheme)
        put("weight_granularity", weights)
        put("fp8_format", parse(Fp8Format, self.fp8_format, "fp8_format"))
        put("kernel", parse(Kernel, self.kernel, "kernel"))
        put(
            "weight_scale_method",
            parse(WeightScaleMethod, self.weight_scale_method, "weight_scale_method"),
        )
        put("block_size", _block_size(self.block_size))
        accepted = ACTIVATION_GRANULARITY_TABLE[scheme][weights]
        act = self.activation_granularity
        if not accepted:
            if act is not None:
                raise ValueError(
                    f"activation_granularity must be None for activation_scheme={scheme.value!r} "
                    f"(activations are not quantized), got {act!r}"
                )
        else:
            act = parse(ActivationGranularity, act, "activation_granularity")
            if act not in accepted:
                hint = (
                    "static activation scales are per tensor: use activation_granularity="
                    "'tensor' (or activation_scheme='dynamic' for per-token scales)"
                    if scheme is ActivationScheme.STATIC
                    else f"use one of {tuple(a.value for a in accepted)}"
                )
                raise ValueError(
                    f"activation_granularity={act.value!r} does not go with "
                    f"activation_scheme={scheme.value!r} and weight_granularity="
                    f"{weights.value!r}; {hint}"
                )
        put("activation_granularity", act)
        if scheme is ActivationScheme.WEIGHT_ONLY and self.kernel is Kernel.SCALED_MM:
            raise ValueError(
                "kernel='scaled_mm' needs FP8 activations; activation_scheme='weight_only' "
                "dequantizes the weight instead: use kernel='auto' or 'emulated'"
            )

    @classmethod
    def resolve(
        cls,
        activation_scheme: str | ActivationScheme = ActivationScheme.DYNAMIC,
        *,
        weight_granularity: str | Granularity = Granularity.ROW,
        activation_granularity: str | ActivationGranularity | None = None,
        fp8_format: str | Fp8Format = Fp8Format.E4M3,
        block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
        kernel: str | Kernel = Kernel.AUTO,
        weight_scale_method: str | WeightScaleMethod = WeightScaleMethod.ABSMAX,
    ) -> Fp8Recipe:
        """A recipe from user words; ``activation_granularity=None`` takes the table's default
        (``"token"`` for dynamic, ``"block"`` with block weights, ``"tensor"`` for static,
        ``None`` for weight-only). Errors name the accepted values. Cached: a model load
        resolves the same words once, not once per layer."""
        # validated before the cache: its keys compare 32.0 == 32 and True == 1
        block = _block_size(block_size)
        try:
            return _resolve_cached(
                cls, activation_scheme, weight_granularity, activation_granularity, fp8_format,
                block, kernel, weight_scale_method,
            )  # fmt: skip
        except TypeError:  # unhashable words: the error path
            pass
        return cls._resolve(
            activation_scheme, weight_granularity, activation_granularity, fp8_format,
            block, kernel, weight_scale_method,
        )  # fmt: skip

    @classmethod
    def _resolve(
        cls,
        activation_scheme: Any,
        weight_granularity: Any,
        activation_granularity: Any,
        fp8_format: Any,
        block_size: Any,
        kernel: Any,
        weight_scale_method: Any,
    ) -> Fp8Recipe:
        scheme = parse(ActivationScheme, activation_scheme, "activation_scheme")
        weights = parse(Granularity, weight_granularity, "weight_granularity")
        if activation_granularity is None:
            accepted = ACTIVATION_GRANULARITY_TABLE[scheme][weights]
            activation_granularity = accepted[0] if accepted else None
        return cls(
            scheme,
            weights,
            activation_granularity,
            fp8_format,
            block_size,  # validated in __post_init__
            kernel,
            weight_scale_method,
        )

    # -- derived facts (read these instead of re-deriving them) ----------------------------------
    @property
    def quantizes_activations(self) -> bool:
        """False for weight-only recipes."""
        return self.activation_granularity is not None

    @property
    def is_static(self) -> bool:
        return self.activation_scheme is ActivationScheme.STATIC

    @property
    def activation_layout(self) -> Granularity | None:
        """Numerics layout of the activation scale (``"row"`` for ``"token"``); ``None``:
        weight-only."""
        act = self.activation_granularity
        return None if act is None else act.layout

    @property
    def activation_block_size(self) -> tuple[int, int]:
        """``(1, block_size[1])``: activation blocks are one token high."""
        return (1, self.block_size[1])

    def to_strings(self) -> dict[str, Any]:
        """The recipe as plain JSON values (the words a user would write)."""
        return {
            "activation_scheme": self.activation_scheme.value,
            "weight_granularity": self.weight_granularity.value,
            "activation_granularity": (
                None if self.activation_granularity is None else self.activation_granularity.value
            ),
            "fp8_format": self.fp8_format.value,
            "block_size": list(self.block_size),
            "kernel": self.kernel.value,
            "weight_scale_method": self.weight_scale_method.value,
        }
