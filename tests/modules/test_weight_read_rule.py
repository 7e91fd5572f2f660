"""The weight-read-directly rule, read from the parent's source: a linear whose parent
multiplies ``self.<child>.weight`` itself stays in high precision (Mamba's ``dt_proj`` was
converted, and its mixer then multiplied fp8 codes: "expected scalar type Float but found
Float8_e4m3fn")."""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn

from hf_fp8 import Fp8Config
from hf_fp8.modules import Fp8Linear, convertible_modules, keep_reason


class _ReadsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.called = nn.Linear(8, 8)
        self.used.weight.data.zero_()  # reading in __init__ does not count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.called(x) @ self.used.weight


def test_a_child_whose_weight_the_parent_reads_is_kept() -> None:
    model = nn.Sequential(_ReadsWeight())
    names = [n for n, _, _ in convertible_modules(model)]
    assert names == ["0.called"]
    parent = model[0]
    assert "reads its .weight directly" in keep_reason(parent.used, "0.used", parent=parent)


def test_mamba_loads_and_runs_in_fp8(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = tf.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2)
    ref = tf.MambaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Fp8Config())
    mixer = model.backbone.layers[0].mixer
    assert isinstance(mixer.in_proj, Fp8Linear)
    assert type(mixer.dt_proj) is nn.Linear  # read as mixer.dt_proj.weight @ ...
    assert isinstance(mixer.x_proj, Fp8Linear)  # called as a module on this path
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert float((got - want).norm() / want.norm()) < 0.1
