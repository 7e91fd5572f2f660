"""Kernel and module tests run the eager emulation unless they ask for the ``compiled``
fixture: each inductor compilation costs seconds on a cold cache, so only a few are
exercised. Their conftests import these fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_FP8_COMPILE", "0")


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the inductor-compiled helpers (the default outside the tests)."""
    monkeypatch.setenv("HF_FP8_COMPILE", "1")
