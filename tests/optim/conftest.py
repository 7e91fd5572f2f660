"""Fixtures for the optimizer tests: the Trainer names are registered explicitly here, so
the tests do not depend on ``import hf_fp8`` doing it."""

from __future__ import annotations

import pytest

from hf_fp8.optim import register_trainer_optimizers


@pytest.fixture(scope="session", autouse=True)
def _register_trainer_names() -> None:
    register_trainer_optimizers()
