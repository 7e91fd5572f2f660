"""Shared fixtures."""

from tests.tiny_models import llama_fp8_dir, tiny_model_dir  # noqa: F401
