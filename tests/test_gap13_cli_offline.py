"""``hf-fp8 push`` with ``HF_HUB_OFFLINE=1`` set: the advice must be to unset it, not to set it."""

from __future__ import annotations

import torch

from hf_fp8.cli import main
from tests.tiny_models import TINY


def test_push_while_offline_says_to_unset_hf_hub_offline(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).save_pretrained(tmp_path / "float")
    assert main(["quantize", str(tmp_path / "float"), "--out", str(tmp_path / "fp8")]) == 0
    capsys.readouterr()
    code = main(["push", str(tmp_path / "fp8"), "org/tiny-fp8"])
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("hf-fp8")]
    assert code == 1
    assert "unset HF_HUB_OFFLINE" in line, line
    assert "set HF_HUB_OFFLINE=1" not in line, line
