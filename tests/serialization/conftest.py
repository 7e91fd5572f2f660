"""Fixtures: tiny models and eager FP8 kernels (serialization, not numerics, is under test)."""

import pytest

from tests.tiny_models import tiny_model_dir  # noqa: F401


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
