"""Fixtures: tiny models, eager FP8 kernels, a local stand-in for the Hub."""

import huggingface_hub.constants
import pytest
import transformers.utils.hub

from tests.hub.fake_hub import FakeHubApi, block_network
from tests.tiny_models import tiny_model_dir  # noqa: F401


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    monkeypatch.setenv("HF_FP8_COMPILE", "0")  # numerics are not under test here; skip inductor


@pytest.fixture
def fake_hub(tmp_path, monkeypatch) -> FakeHubApi:
    """``hf_api()`` replaced by a recorder; the Hub cache is a fresh folder; no network."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    api = FakeHubApi(cache)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", api)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    block_network(monkeypatch)
    return api
