"""Shared fixtures."""

from tests.tiny_models import tiny_model_dir  # noqa: F401
