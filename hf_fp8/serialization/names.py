"""The names of the foreign on-disk formats (standard library only: the CLI's choices read
them without importing torch). ``formats.FORMATS`` maps each name to its converters."""

from __future__ import annotations

COMPRESSED_TENSORS = "compressed-tensors"
VLLM_FP8 = "vllm-fp8"
EXPORT_FORMATS: tuple[str, ...] = (COMPRESSED_TENSORS, VLLM_FP8)
FORMAT_ALIASES = {"ct": COMPRESSED_TENSORS, "fp8": VLLM_FP8, "vllm": VLLM_FP8}
