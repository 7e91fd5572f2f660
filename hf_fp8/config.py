"""``Fp8Config``: the one FP8 recipe, for ``from_pretrained`` and ``quantize_model`` alike."""

from __future__ import annotations

from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from hf_fp8.kernels import check_kernel
from hf_fp8.modules import default_activation_granularity, validate_scheme
from hf_fp8.numerics import SCALE_METHODS, fp8_dtype

QUANT_METHOD = "hf_fp8"


class Fp8Config(QuantizationConfigMixin):
    """FP8 quantization recipe.

    Args:
        activation_scheme: ``"dynamic"`` (activation scale computed per call),
            ``"static"`` (scale given here or calibrated with ``hf_fp8.calibrate``) or
            ``"weight_only"``.
        weight_granularity: ``"row"`` (per output channel, default), ``"tensor"`` or
            ``"block"`` (``block_size`` tiles).
        activation_granularity: ``"token"`` (dynamic default), ``"tensor"`` (static
            default) or ``"block"`` (1 × ``block_size[1]``, dynamic default with block
            weights). ``None`` picks the default.
        fp8_format: ``"e4m3"`` (default) or ``"e5m2"``.
        block_size: ``[rows, cols]`` of a weight block (default ``[128, 128]``).
        modules_to_not_convert: module names (or dotted name parts) kept in high precision,
            on top of transformers' default skips (output embeddings, tied weights,
            ``_keep_in_fp32_modules``). A loaded model stores the resolved list here, so a
            saved checkpoint reloads exactly the layers it has (``[]``: all of them FP8).
        activation_scale: static scale used by every layer.
        activation_scales: static scales per module name (override ``activation_scale``).
        kernel: ``"auto"``, ``"scaled_mm"`` or ``"emulated"``.
        weight_scale_method: ``"absmax"`` (``amax / fp8_max``, default) or ``"mse"``
            (per-group clipping that minimises the weight's squared error; slower to
            quantize, same format on disk).
        dequantize: load an FP8 checkpoint back into high precision.
    """

    def __init__(
        self,
        activation_scheme: str = "dynamic",
        *,
        weight_granularity: str = "row",
        activation_granularity: str | None = None,
        fp8_format: str = "e4m3",
        block_size: list[int] | tuple[int, int] = (128, 128),
        modules_to_not_convert: list[str] | None = None,
        activation_scale: float | None = None,
        activation_scales: dict[str, float] | None = None,
        kernel: str = "auto",
        weight_scale_method: str = "absmax",
        dequantize: bool = False,
        quant_method: str = QUANT_METHOD,
    ) -> None:
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        self.quant_method = QUANT_METHOD
        self.activation_scheme = activation_scheme
        self.weight_granularity = weight_granularity
        if activation_granularity is None and activation_scheme in (
            "dynamic",
            "static",
            "weight_only",
        ):
            activation_granularity = default_activation_granularity(
                activation_scheme, weight_granularity
            )
        self.activation_granularity = activation_granularity
        self.fp8_format = fp8_format
        self.block_size = [int(b) for b in block_size]
        self.modules_to_not_convert = (
            None if modules_to_not_convert is None else list(modules_to_not_convert)
        )
        self.activation_scale = None if activation_scale is None else float(activation_scale)
        self.activation_scales = (
            {str(k): float(v) for k, v in activation_scales.items()} if activation_scales else None
        )
        self.kernel = kernel
        self.weight_scale_method = weight_scale_method
        self.dequantize = bool(dequantize)
        self.post_init()

    def post_init(self) -> None:
        """Validate every field; errors name the accepted values."""
        validate_scheme(
            self.activation_scheme, self.weight_granularity, self.activation_granularity
        )
        fp8_dtype(self.fp8_format)
        check_kernel(self.kernel)
        if self.weight_scale_method not in SCALE_METHODS:
            raise ValueError(
                f"weight_scale_method={self.weight_scale_method!r} is not supported; use one "
                f"of {SCALE_METHODS}"
            )
        if len(self.block_size) != 2 or min(self.block_size) < 1:
            raise ValueError(
                f"block_size must be two positive ints [rows, cols], got {self.block_size}"
            )
        scales = [self.activation_scale, *(self.activation_scales or {}).values()]
        if any(s is not None and not (s > 0 and s < float("inf")) for s in scales):
            raise ValueError("activation scales must be positive finite numbers")
        if self.activation_scheme != "static" and any(s is not None for s in scales):
            raise ValueError(
                "activation_scale / activation_scales are only used with activation_scheme='static'"
            )

    def linear_kwargs(self, module_name: str = "") -> dict[str, Any]:
        """Keyword arguments of ``Fp8Linear`` for the module called ``module_name``."""
        scale = (self.activation_scales or {}).get(module_name, self.activation_scale)
        return {
            "activation_scheme": self.activation_scheme,
            "weight_granularity": self.weight_granularity,
            "activation_granularity": self.activation_granularity,
            "fp8_format": self.fp8_format,
            "block_size": tuple(self.block_size),
            "kernel": self.kernel,
            "input_scale": scale,
        }

    def get_loading_attributes(self) -> dict[str, Any]:
        """Fields a user may override when loading a saved FP8 checkpoint."""
        return {"dequantize": self.dequantize, "kernel": self.kernel}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fp8Config) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable
