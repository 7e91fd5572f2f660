"""On-disk formats: compressed-tensors / vLLM ``fp8`` export and import, checkpoint inspection."""

from hf_fp8.serialization.checkpoint import Checkpoint, resolve_checkpoint
from hf_fp8.serialization.export import export, export_checkpoint
from hf_fp8.serialization.formats import EXPORT_FORMATS, format_of, get_format
from hf_fp8.serialization.importer import import_checkpoint
from hf_fp8.serialization.summary import CheckpointSummary, inspect_checkpoint

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
