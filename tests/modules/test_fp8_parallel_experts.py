"""Fp8ParallelExperts: JetMoE's parallel experts linears (outside transformers' experts
interface, 97.6 % of JetMoE-8B) in FP8, recognised from their structure; the reference is the
source module on the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules import keep_reason
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts, parallel_experts_layout
from tests.bitwise import assert_states_bit_equal

SIZES = [3, 0, 5, 2]  # rows per expert; expert 1 gets none


class BmmParallel(nn.Module):
    """Same parameter, another computation (one bmm over equal chunks): not recognised."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 24, 16))

    def forward(self, inputs, expert_size):
        return torch.bmm(inputs.view(4, -1, 16), self.weight.transpose(1, 2)).view(-1, 24)


def _experts(seed: int = 0) -> JetMoeParallelExperts:
    torch.manual_seed(seed)
    module = JetMoeParallelExperts(4, 16, 24)
    nn.init.normal_(module.weight, std=0.1)
    return module


def test_the_layout_is_read_from_the_module() -> None:
    layout = parallel_experts_layout(_experts())
    assert layout is not None and layout.source_class is JetMoeParallelExperts
    assert layout.projections == ("weight",) and layout.shape("weight") == (4, 24, 16)
    assert parallel_experts_layout(BmmParallel()) is None
    assert parallel_experts_layout(Llama4TextExperts(tf.Llama4TextConfig(hidden_size=8))) is None
    assert parallel_experts_layout(nn.Linear(4, 4)) is None


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
def test_forward_equals_the_source_on_dequantized_weights(scheme: str) -> None:
    fp8 = Fp8ParallelExperts.from_experts(_experts(), Fp8Config(scheme))
    reference = fp8.dequantize()
    assert type(reference) is JetMoeParallelExperts and reference.weight.shape == (4, 24, 16)
    x = torch.randn(sum(SIZES), 16)
    with torch.no_grad():
        want, got = reference(x, SIZES), fp8(x, SIZES)
    assert got.shape == (10, 24)
    if scheme == "weight_only":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # activations rounded to e4m3 per token
        assert float((got - want).norm() / want.norm()) < 0.05


def test_sizes_that_do_not_fit_are_refused() -> None:
    fp8 = Fp8ParallelExperts.from_experts(_experts(), Fp8Config())
    with pytest.raises(ValueError, match="one count per expert"):
        fp8(torch.randn(10, 16), [5, 5])
    with pytest.raises(ValueError, match="summing to the 10 input rows"):
        fp8(torch.randn(10, 16), [5, 5, 1, 0])


def test_selection_and_static_calibration_per_expert() -> None:
    holder = nn.Module()
    holder.input_linear = _experts()
    assert keep_reason(holder.input_linear, "input_linear", parent=holder) == (
        "MoE experts: converted by Fp8ParallelExperts"
    )
    fp8 = Fp8ParallelExperts.from_experts(holder.input_linear, Fp8Config("static"))

    class Call(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = fp8

        def forward(self, x):
            return self.experts(x, SIZES)

    x = torch.randn(sum(SIZES), 16)
    scales = hf_fp8.calibrate(Call(), [x], progress=False)
    starts = [0, 3, 3, 8]
    for e in (0, 2, 3):
        rows = x[starts[e] : starts[e] + SIZES[e]]
        expected = float(rows.abs().max()) / 448
        assert scales[f"experts.weight[{e}]"] == pytest.approx(expected, rel=1e-6)


def test_jetmoe_from_pretrained_quantizes_saves_and_reloads_bit_exact(tmp_path) -> None:
    torch.manual_seed(0)
    config = tf.JetMoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = tf.JetMoeForCausalLM(config).eval()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "hp")
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("weight_only")
    ).eval()
    converted = [n for n, m in fp8.named_modules() if isinstance(m, Fp8ParallelExperts)]
    assert len(converted) == 8  # MLP and attention experts, input and output, 2 layers
    with torch.no_grad():
        got = fp8(ids).logits
    assert float((got - want).norm() / want.norm()) < 0.05
    fp8.save_pretrained(tmp_path / "fp8")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").eval()
    assert_states_bit_equal(fp8, back)
    deq = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=Fp8Config(dequantize=True)
    ).eval()
    assert type(deq.model.layers[0].mlp.input_linear) is JetMoeParallelExperts
    with torch.no_grad():
        assert torch.equal(back(ids).logits, got)
        torch.testing.assert_close(deq(ids).logits, got, rtol=1e-5, atol=1e-5)


class ScaledParallel(JetMoeParallelExperts):
    """JetMoE's forward with each expert's output scaled: not the plain linear."""

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = []
        for i in range(self.num_experts):
            output_list.append(nn.functional.linear(input_list[i], self.weight[i]) * 2.0)
        return torch.cat(output_list, dim=0)


class ActivatedParallel(JetMoeParallelExperts):
    """JetMoE's forward with an activation after the linear (another call)."""

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = []
        for i in range(self.num_experts):
            output_list.append(torch.relu(nn.functional.linear(input_list[i], self.weight[i])))
        return torch.cat(output_list, dim=0)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A module-level function named like ``F.linear`` that is not it."""
    return nn.functional.linear(x, w).relu()


class SplitHidesActivation(JetMoeParallelExperts):
    """The function form of split carries a tanh in its tensor argument."""

    def forward(self, inputs, expert_size):
        input_list = torch.split(torch.tanh(inputs), expert_size, dim=0)
        output_list = []
        for i in range(self.num_experts):
            output_list.append(nn.functional.linear(input_list[i], self.weight[i]))
        return torch.cat(output_list, dim=0)


class OtherLinear(JetMoeParallelExperts):
    """Calls a function named ``linear`` that is not ``torch.nn.functional.linear``."""

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = []
        for i in range(self.num_experts):
            output_list.append(linear(input_list[i], self.weight[i]))
        return torch.cat(output_list, dim=0)


@pytest.mark.parametrize(
    "cls", [ScaledParallel, ActivatedParallel, SplitHidesActivation, OtherLinear]
)
def test_look_alike_forwards_with_other_operations_stay_high_precision(cls: type) -> None:
    module = cls(4, 16, 24)
    assert parallel_experts_layout(module) is None
    with pytest.raises(ValueError, match="not a parallel experts linear"):
        Fp8ParallelExperts.from_experts(module, Fp8Config("weight_only"))
