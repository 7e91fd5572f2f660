"""On-disk formats: compressed-tensors / vLLM ``fp8`` export and import, checkpoint inspection.

Names load on first use, so that ``hf_fp8.serialization.names`` (the format vocabulary, no
torch) stays cheap for the CLI's ``--help``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "EXPORT_FORMATS": "hf_fp8.serialization.formats",
    "Checkpoint": "hf_fp8.serialization.checkpoint",
    "CheckpointSummary": "hf_fp8.serialization.summary",
    "export": "hf_fp8.serialization.exporter",
    "export_checkpoint": "hf_fp8.serialization.exporter",
    "format_of": "hf_fp8.serialization.formats",
    "get_format": "hf_fp8.serialization.formats",
    "import_checkpoint": "hf_fp8.serialization.importer",
    "inspect_checkpoint": "hf_fp8.serialization.summary",
    "resolve_checkpoint": "hf_fp8.serialization.checkpoint",
}
__all__ = [
    "EXPORT_FORMATS",
    "Checkpoint",
    "CheckpointSummary",
    "export",
    "export_checkpoint",
    "format_of",
    "get_format",
    "import_checkpoint",
    "inspect_checkpoint",
    "resolve_checkpoint",
]

if TYPE_CHECKING:
    from hf_fp8.serialization.checkpoint import Checkpoint, resolve_checkpoint
    from hf_fp8.serialization.exporter import export, export_checkpoint
    from hf_fp8.serialization.formats import EXPORT_FORMATS, format_of, get_format
    from hf_fp8.serialization.importer import import_checkpoint
    from hf_fp8.serialization.summary import CheckpointSummary, inspect_checkpoint


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_fp8.serialization' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
