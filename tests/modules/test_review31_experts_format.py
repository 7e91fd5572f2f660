"""Reviewer R31 F2: expert codes of the other FP8 format (e5m2 codes into an e4m3 module) were
loaded silently by ``load_state_dict`` (``copy_`` converts the code values, e5m2's 57344
saturates at 448, outputs ~128x too small). ``Fp8Linear`` refuses the same state dict with a
``CheckpointTensorError``; every experts class must too, and stay unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_bmm_experts import Fp8BmmExperts
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts
from hf_fp8.numerics.checks import CheckpointTensorError


def _qwen() -> nn.Module:
    return Qwen3MoeExperts(
        tf.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4)
    )


def _llama4() -> nn.Module:
    cfg = tf.Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    return Llama4TextExperts(cfg)


def _jetmoe() -> nn.Module:
    return JetMoeParallelExperts(4, 16, 24)


KINDS = {
    "experts": (Fp8Experts, _qwen, "gate_up_proj"),
    "bmm": (Fp8BmmExperts, _llama4, "gate_up_proj"),
    "parallel": (Fp8ParallelExperts, _jetmoe, "weight"),
}


def _pair(kind: str, scheme: str = "weight_only"):
    cls, make, first = KINDS[kind]
    torch.manual_seed(0)
    source = make()
    for p in source.parameters():
        nn.init.normal_(p, std=0.1)
    e4 = cls.from_experts(copy.deepcopy(source), Fp8Config(scheme))
    e5 = cls.from_experts(copy.deepcopy(source), Fp8Config(scheme, fp8_format="e5m2"))
    return e4, e5, first


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_other_format_codes_are_refused_and_nothing_changes(kind: str) -> None:
    e4, e5, first = _pair(kind)
    before = {k: v.clone() for k, v in e4.state_dict().items()}
    with pytest.raises(CheckpointTensorError, match=rf"{first}: stored as fp8 e5m2.*e4m3"):
        e4.load_state_dict(e5.state_dict())
    after = e4.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype
        assert torch.equal(after[key].view(torch.uint8), value.view(torch.uint8)), key


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_e4m3_codes_into_an_e5m2_module_are_refused(kind: str) -> None:
    e4, e5, first = _pair(kind)
    with pytest.raises(CheckpointTensorError, match=rf"{first}: stored as fp8 e4m3.*e5m2"):
        e5.load_state_dict(e4.state_dict())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_wrong_shape_names_the_key(kind: str) -> None:
    e4, _, first = _pair(kind)
    state = e4.state_dict()
    state[first] = state[first][:, :-1].contiguous()
    with pytest.raises(CheckpointTensorError, match=rf"{first}: expected shape"):
        e4.load_state_dict(state)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_same_format_still_loads_bit_for_bit(kind: str) -> None:
    e4, _, _ = _pair(kind)
    other, _, _ = _pair(kind)
    for p in other._frozen():
        p.data.zero_()
    other.load_state_dict(e4.state_dict())
    for key, value in e4.state_dict().items():
        got = other.state_dict()[key]
        assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), key
