"""The FP8 error of an MoE model against a dense model of the same family (issue 11 target:
within 1.2x, measured on random models by ``benchmarks/bench_moe_accuracy.py``).

Here the comparison is made exact: a Qwen3-MoE whose every expert is a copy of a dense Qwen3's
MLP (same attention, norms, embeddings; top-k weights normalised) computes the dense model's
function, whatever the router picks. In FP8 each expert is then quantized like the dense
linear it copies (per-expert row scales = the dense row scales), so the FP8 MoE must give the
dense FP8 model's logits and error: ``weight_only`` and ``dynamic`` to rounding, ``static``
(one calibrated scale per expert instead of one per layer) within the 1.2x target."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import hf_fp8
from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.modules import Fp8Experts

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
EXPERTS = 4


def _dense_and_moe() -> tuple[tf.PreTrainedModel, tf.PreTrainedModel]:
    torch.manual_seed(0)
    dense = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SIZES)).eval()
    moe_config = tf.Qwen3MoeConfig(
        **SIZES,
        moe_intermediate_size=SIZES["intermediate_size"],
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    moe = tf.Qwen3MoeForCausalLM(moe_config).eval()
    state = moe.state_dict()
    dense_state = dense.state_dict()
    for key in state:
        if key in dense_state:
            state[key] = dense_state[key].clone()
    for i in range(SIZES["num_hidden_layers"]):
        mlp = f"model.layers.{i}.mlp"
        gate, up, down = (dense_state[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        state[f"{mlp}.experts.gate_up_proj"] = torch.cat([gate, up]).expand(EXPERTS, -1, -1)
        state[f"{mlp}.experts.down_proj"] = down.expand(EXPERTS, -1, -1)
    moe.load_state_dict({k: v.contiguous() for k, v in state.items()})
    return dense, moe


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(seed))


def _fp8(model: tf.PreTrainedModel, scheme: str) -> tf.PreTrainedModel:
    out = quantize_model(copy.deepcopy(model), Fp8Config(scheme), skip=["lm_head"])
    if scheme == "static":
        hf_fp8.calibrate(out, [{"input_ids": _ids(s)} for s in (1, 2, 3)], progress=False)
    return out.eval()


@pytest.fixture(scope="module")
def models() -> tuple[tf.PreTrainedModel, tf.PreTrainedModel]:
    return _dense_and_moe()


def _logits(model: tf.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def test_moe_of_dense_copies_computes_the_dense_model(models) -> None:
    dense, moe = models
    ids = _ids(0)
    torch.testing.assert_close(_logits(moe, ids), _logits(dense, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic", "static"])
def test_fp8_moe_error_matches_its_dense_model(models, scheme: str) -> None:
    dense, moe = models
    ids = _ids(0)
    want = _logits(dense, ids)
    dense_fp8, moe_fp8 = _fp8(dense, scheme), _fp8(moe, scheme)
    assert sum(isinstance(m, Fp8Experts) for m in moe_fp8.modules()) == 2
    got_dense, got_moe = _logits(dense_fp8, ids), _logits(moe_fp8, ids)
    dense_error = float((got_dense - want).norm() / want.norm())
    moe_error = float((got_moe - want).norm() / want.norm())
    assert dense_error > 1e-3  # FP8 did change the outputs: the comparison means something
    if scheme == "static":  # per-expert input scales: never coarser than the layer's one
        assert moe_error <= 1.2 * dense_error, (moe_error, dense_error)
    else:  # same codes, same scales, same activation quantization: the same logits
        torch.testing.assert_close(got_moe, got_dense, rtol=1e-4, atol=1e-4)
        assert moe_error == pytest.approx(dense_error, rel=1e-3)
