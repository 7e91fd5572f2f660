"""Fp8BmmExperts: Llama-4's experts (outside transformers' experts interface, 91 % of Llama-4
Scout) in FP8, recognised from their structure; the reference is the source module on the
dequantized weights."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts, Llama4TextMoe

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules import keep_reason
from hf_fp8.modules.experts_kinds import convertible_outside_experts
from hf_fp8.modules.fp8_bmm_experts import Fp8BmmExperts, bmm_experts_layout
from tests.bitwise import assert_states_bit_equal
from tests.modules.moe_zoo import build_tiny, experts_classes

TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    intermediate_size_mlp=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=1,
    max_position_embeddings=64,
)


def _moe(seed: int = 0) -> Llama4TextMoe:
    torch.manual_seed(seed)
    moe = Llama4TextMoe(tf.Llama4TextConfig(**TEXT)).eval()
    for p in moe.parameters():
        nn.init.normal_(p, std=0.1)
    return moe


class UpFirstExperts(Llama4TextExperts):
    """Same parameters, but the activation on the second half: not Llama-4's math."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        up, gate = torch.bmm(hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, self.hidden_size)


def test_the_layout_is_read_from_the_module() -> None:
    experts = _moe().experts
    layout = bmm_experts_layout(experts)
    assert layout is not None and layout.source_class is Llama4TextExperts
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size) == (4, 32, 48)
    assert layout.is_transposed and layout.has_gate and not layout.has_bias
    assert bmm_experts_layout(UpFirstExperts(tf.Llama4TextConfig(**TEXT))) is None
    assert bmm_experts_layout(JetMoeParallelExperts(4, 8, 16)) is None
    qwen3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")
    assert bmm_experts_layout(build_tiny(qwen3)) is None  # on the interface: Fp8Experts


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
def test_forward_equals_the_source_on_dequantized_weights(scheme: str) -> None:
    moe = _moe()
    x = torch.randn(2, 5, 32)
    fp8 = Fp8BmmExperts.from_experts(moe.experts, Fp8Config(scheme))
    reference = fp8.dequantize()
    assert type(reference) is Llama4TextExperts
    with torch.no_grad():
        moe.experts = reference
        want, _ = moe(x)
        moe.experts = fp8
        got, _ = moe(x)
    if scheme == "weight_only":  # same weights, same math, only the zero rows skipped
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # activations rounded to e4m3 per token (~2^-4 relative each)
        assert float((got - want).norm() / want.norm()) < 0.05


def test_rows_not_routed_stay_zero_and_nan_rows_stay_nan() -> None:
    fp8 = Fp8BmmExperts.from_experts(_moe().experts, Fp8Config("dynamic"))
    rows = torch.randn(4 * 3, 32)
    rows[[1, 5, 6]] = 0.0  # tokens no expert was routed: zero inputs
    rows[7, 0] = float("nan")
    out = fp8(rows)
    assert out.shape == rows.shape
    assert torch.equal(out[[1, 5, 6]], torch.zeros(3, 32))
    assert torch.isnan(out[7]).all() and torch.isfinite(out[[0, 2, 3, 4, 8]]).all()


def test_selection_converts_it_and_skip_keeps_it() -> None:
    moe = _moe()
    assert keep_reason(moe.experts, "experts", parent=moe) == (
        "MoE experts: converted by Fp8BmmExperts"
    )
    assert [(n, c) for n, _, _, c in convertible_outside_experts(moe)] == [
        ("experts", Fp8BmmExperts)
    ]
    assert convertible_outside_experts(moe, skip=["experts"]) == []
    assert "modules_to_not_convert" in keep_reason(moe.experts, "experts", skip=["experts"])


def test_static_scales_are_calibrated_per_expert_on_routed_rows() -> None:
    moe = _moe()
    fp8 = Fp8BmmExperts.from_experts(moe.experts, Fp8Config("static"))
    moe.experts = fp8
    x = torch.randn(3, 4, 32)
    scores, _ = moe.router(x.reshape(-1, 32))  # [T, E], 0 where not routed
    scales = hf_fp8.calibrate(moe, [x], progress=False)
    routed_in = x.reshape(-1, 32).repeat(4, 1) * scores.T.reshape(-1, 1)
    per_expert = routed_in.view(4, -1, 32)
    for e in range(4):
        live = per_expert[e][(per_expert[e] != 0).any(-1)]
        if len(live):
            expected = float(live.abs().max()) / 448
            assert scales[f"experts.gate_up_proj[{e}]"] == pytest.approx(expected, rel=1e-6)


def test_from_pretrained_quantizes_saves_and_reloads_bit_exact(tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**TEXT)).eval()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "hp")
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("dynamic")
    ).eval()
    assert all(isinstance(layer.feed_forward.experts, Fp8BmmExperts) for layer in fp8.model.layers)
    assert fp8.model.layers[0].feed_forward.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        got = fp8(ids).logits
    assert float((got - want).norm() / want.norm()) < 0.1
    fp8.save_pretrained(tmp_path / "fp8")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").eval()
    assert_states_bit_equal(fp8, back)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, got)
    deq = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=Fp8Config(dequantize=True)
    )
    assert type(deq.model.layers[0].feed_forward.experts) is Llama4TextExperts


def test_quantize_model_converts_llama4_experts() -> None:
    model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**TEXT))
    hf_fp8.quantize_model(model, Fp8Config(), skip=["lm_head"])
    assert isinstance(model.model.layers[0].feed_forward.experts, Fp8BmmExperts)


def test_conversion_refuses_other_modules_and_fp8_weights() -> None:
    """The bmm and parallel kinds refuse what they cannot read, naming the module."""
    from hf_fp8.modules import Fp8ParallelExperts

    with pytest.raises(ValueError, match="cannot convert up_first: it is not a bmm experts"):
        Fp8BmmExperts.from_experts(
            UpFirstExperts(tf.Llama4TextConfig(**TEXT)), module_name="up_first"
        )
    experts = _moe().experts
    experts.down_proj.data = experts.down_proj.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"down_proj is torch\.float8_e4m3fn, not high precision"):
        Fp8BmmExperts.empty_like(experts, Fp8Config(), device="meta")
    parallel = JetMoeParallelExperts(4, 8, 16)
    parallel.weight.data = parallel.weight.data.to(torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"weight is torch\.float8_e5m2, not high precision"):
        Fp8ParallelExperts.from_experts(parallel)
    with pytest.raises(ValueError, match="it is not a parallel experts linear"):
        Fp8ParallelExperts.from_experts(experts)


class ScaledOutputExperts(Llama4TextExperts):
    """Llama-4's forward plus one multiplication of the output: converting it as the plain
    kind would drop the factor silently."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
        return next_states.view(-1, self.hidden_size) * 0.5


class ClampedExperts(Llama4TextExperts):
    """Llama-4's forward with the gate/up product clamped (another call)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj).clamp(-7, 7)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class BranchingExperts(Llama4TextExperts):
    """Llama-4's forward behind a branch the source text alone cannot decide."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.training:
            up = up.neg()
        next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class ReshapeHidesOperations(Llama4TextExperts):
    """The function form of reshape carries a clamp and a scale in its tensor argument."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (self.gate_up_proj.shape[0], -1, self.hidden_size)
        hidden_states = torch.reshape(hidden_states.clamp(-1, 1) * 0.5, shape)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class OwnBmmMethod(Llama4TextExperts):
    """``self.bmm`` is a method of the class that scales: not ``torch.bmm``."""

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b) * 2.0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = self.bmm((up * self.act_fn(gate)), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class TransposedDown(Llama4TextExperts):
    """The down projection read transposed (an attribute, not a call)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj.mT)
        return next_states.view(-1, self.hidden_size)


class OwnCall(Llama4TextExperts):
    """Llama-4's forward, but the call scales its result."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 2.0


LOOK_ALIKES = [
    ScaledOutputExperts,
    ClampedExperts,
    BranchingExperts,
    ReshapeHidesOperations,
    OwnBmmMethod,
    TransposedDown,
    OwnCall,
]


@pytest.mark.parametrize("cls", LOOK_ALIKES)
def test_look_alike_forwards_with_other_operations_stay_high_precision(cls: type) -> None:
    experts = cls(tf.Llama4TextConfig(**TEXT))
    assert bmm_experts_layout(experts) is None
    with pytest.raises(ValueError, match="not a bmm experts module"):
        Fp8BmmExperts.from_experts(experts, Fp8Config("weight_only"))


def test_hooks_or_an_instance_forward_keep_llama4_experts_in_high_precision() -> None:
    hooked = Llama4TextExperts(tf.Llama4TextConfig(**TEXT))
    hooked.register_forward_hook(lambda module, args, out: out * 2.0)
    assert bmm_experts_layout(hooked) is None
    patched = Llama4TextExperts(tf.Llama4TextConfig(**TEXT))
    patched.forward = lambda hidden_states: hidden_states
    assert bmm_experts_layout(patched) is None
