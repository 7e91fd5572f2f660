"""Moved: ``hf_fp8.export`` lives in ``hf_fp8.serialization.exporter`` (hub code only writes cards
and uploads). Kept so that ``from hf_fp8.hub.sharing import export`` still works."""

from hf_fp8.serialization.exporter import export

__all__ = ["export"]
