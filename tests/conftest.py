"""Test-wide settings: never reach the Hub; every test starts from the same seeds."""

import os
import random

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)
