"""is_convertible / convertible_modules: the one rule for which layers become Fp8Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AfmoeConfig,
    Llama4TextConfig,
    MixtralConfig,
    PhimoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.afmoe.modeling_afmoe import AfmoeSparseMoeBlock
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.pytorch_utils import Conv1D

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules import convertible_modules, is_convertible, keep_reason

SMALL_MOE = dict(
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
)


def names(model: nn.Module, **kwargs) -> list[str]:
    return [name for name, _, _ in convertible_modules(model, **kwargs)]


def test_linear_conv1d_and_plain_subclasses_convert() -> None:
    model = nn.ModuleDict(
        {
            "linear": nn.Linear(8, 8),
            "conv1d": Conv1D(8, 8),
            "falcon": FalconLinear(8, 8),  # overrides forward with the same math
            "ndq": nn.modules.linear.NonDynamicallyQuantizableLinear(8, 8),  # outside MHA
            "norm": nn.LayerNorm(8),
            "fp8": Fp8Linear.from_linear(nn.Linear(8, 8)),
        }
    )
    assert names(model) == ["linear", "conv1d", "falcon", "ndq"]
    assert keep_reason(model.fp8, "fp8") == "already FP8"
    assert keep_reason(model.norm, "norm") == "not a linear"


class ScaledHead(nn.Linear):
    """Like DoryLMHead: a linear subclass with an extra parameter used in its forward."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.logit_scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.logit_scale


class ExtraParamLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 8)
        self.extra = nn.Parameter(torch.ones(1))


def test_linear_subclasses_with_their_own_behaviour_are_kept() -> None:
    for module in (ScaledHead(), ExtraParamLinear()):
        assert not is_convertible(module, "head")
        assert "subclass with its own behaviour" in keep_reason(module, "head")


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ffn = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.attn(x, x, x, need_weights=False)[0])


def swap_all(model: nn.Module) -> None:
    for name, module, parent in convertible_modules(model):
        setattr(parent, name.rpartition(".")[2], Fp8Linear.from_linear(module))


@pytest.mark.parametrize("grad", [False, True])
def test_modules_that_read_a_child_weight_directly_keep_it(grad: bool) -> None:
    block = AttentionBlock().eval()
    # nn.TransformerEncoderLayer's eval fast path hands linear1/2.weight to one fused op too
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    assert names(block) == ["ffn"] and names(layer) == []
    assert "reads its .weight directly" in keep_reason(
        block.attn.out_proj, "attn.out_proj", parent=block.attn
    )
    x = torch.randn(2, 5, 16)
    with torch.set_grad_enabled(grad):
        ref = block(x)
        swap_all(block)
        out = block(x)
    assert (out - ref).norm() / ref.norm() < 0.05  # raw FP8 codes in out_proj would be ~1


@pytest.mark.parametrize(
    ("config_cls", "block_cls", "converted", "router"),
    [
        (MixtralConfig, MixtralSparseMoeBlock, [], None),  # router and experts are not linears
        (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, [], None),
        (
            Qwen2MoeConfig,
            Qwen2MoeSparseMoeBlock,
            ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"],
            "shared_expert_gate",  # a plain nn.Linear gate beside `experts`
        ),
        (
            AfmoeConfig,
            AfmoeSparseMoeBlock,
            ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"],
            "router.gate",  # a plain nn.Linear inside a *Router module
        ),
        (PhimoeConfig, PhimoeSparseMoeBlock, [], "router"),  # PhimoeTopKRouter(nn.Linear)
        (
            Llama4TextConfig,
            Llama4TextMoe,
            ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"],
            "router",  # Llama4Router(nn.Linear)
        ),
    ],
)
def test_moe_routers_stay_in_high_precision(config_cls, block_cls, converted, router) -> None:
    block = block_cls(config_cls(**SMALL_MOE))
    assert names(block) == converted
    if router is not None:
        module = block.get_submodule(router)
        parent = block.get_submodule(router.rpartition(".")[0])
        assert isinstance(module, nn.Linear)
        assert keep_reason(module, router, parent=parent).startswith("MoE router")


class GatedBlock(nn.Module):
    """A non-MoE block with a linear called ``gate`` (like D-FINE's gating layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)


class ToyMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


def test_a_gate_is_a_router_only_beside_experts() -> None:
    assert names(GatedBlock()) == ["gate"]
    assert names(ToyMoe()) == ["experts.0", "experts.1", "experts.2", "experts.3"]


def test_skip_patterns_and_module_filter_fn() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 3))
    assert names(model, skip=["2"]) == ["0", "1"]
    small_only = names(model, module_filter_fn=lambda m, fqn: m.out_features % 8 == 0)
    assert small_only == ["0", "1"]
    assert names(model, module_filter_fn=lambda m, fqn: fqn != "0", skip=["1"]) == ["2"]
    assert keep_reason(model[0], "0", module_filter_fn=lambda m, fqn: False) == (
        "module_filter_fn returned False"
    )


def test_lora_adapters_are_not_converted() -> None:
    peft = pytest.importorskip("peft")
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
    found = names(model)
    assert found and not any("lora_" in n for n in found)
    assert "base_model.model.2" in found


def test_a_shared_linear_is_listed_under_each_parent() -> None:
    shared = nn.Linear(8, 8)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    assert names(model) == ["a.0", "b.0"]


def test_the_config_skip_list_uses_the_same_matching() -> None:
    model = nn.ModuleDict({"lm_head": nn.Linear(8, 8), "lm_head2": nn.Linear(8, 8)})
    skip = Fp8Config(modules_to_not_convert=["lm_head"]).modules_to_not_convert
    assert names(model, skip=skip) == ["lm_head2"]


class EinsumAttention(nn.Module):
    """Like XLNetRelativeAttention: projections as 3-D parameters used through einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(8, 2, 4))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bh,hnd->bnd", self.norm(x), self.q)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.attn = EinsumAttention()
        self.conv = nn.Conv1d(8, 8, 3)
        self.router = nn.Linear(8, 4)  # a linear called router beside experts
        self.experts = nn.ModuleList([nn.Linear(8, 8)])
        self.proj = nn.Linear(8, 8)


def _parts(model: nn.Module, **kwargs) -> dict[str, dict]:
    from hf_fp8.modules.selection import high_precision_parts

    return {g["what"]: g for g in high_precision_parts(model, **kwargs)}


def test_high_precision_parts_name_every_part_that_is_not_fp8() -> None:
    model = Toy()
    parts = _parts(model, skip=["proj"])
    assert parts["embeddings"]["parameters"] == 80
    own = parts["parameters used by their module's own code"]
    assert own["parameters"] == 64 and own["examples"] == ["attn.q"]
    assert "EinsumAttention uses these parameters itself" in own["why"]
    assert parts["convolutions"]["parameters"] == 8 * 8 * 3
    assert parts["MoE routers"]["parameters"] == 32
    assert (
        parts["linears kept in high precision"]["why"] == "named in modules_to_not_convert / skip"
    )
    assert parts["linears kept in high precision"]["examples"] == ["proj.weight"]
    assert parts["norms and other 1-D tensors"]["parameters"] == 8  # the LayerNorm weight
    # every bias (norm, conv, router, experts.0, proj); experts.0.weight converts: no group
    assert parts["biases"]["parameters"] == 8 + 8 + 4 + 8 + 8
    listed = sum(g["parameters"] for g in parts.values())
    assert listed == sum(p.numel() for p in model.parameters()) - 64  # all but experts.0.weight


def test_high_precision_parts_of_a_quantized_model_leave_out_fp8_codes_and_scales() -> None:
    from hf_fp8 import quantize_model

    model = quantize_model(Toy(), Fp8Config(), skip=["proj"])
    assert isinstance(model.experts[0], Fp8Linear)
    parts = _parts(model)  # no skip given: the model says what is FP8
    fp8 = sum(p.numel() for p in model.parameters() if p.element_size() == 1)
    scales = sum(p.numel() for n, p in model.named_parameters() if "scale" in n)
    listed = sum(g["parameters"] for g in parts.values())
    assert fp8 == 64 and listed == sum(p.numel() for p in model.parameters()) - fp8 - scales
    kept = parts["linears kept in high precision"]
    assert kept["examples"] == ["proj.weight"] and "when the model was quantized" in kept["why"]


def test_high_precision_parts_of_families_below_the_coverage_target() -> None:
    """What keeps XLNet, Mamba and LongCat-Flash below 0.99 FP8, in words (built on meta);
    the experts of Llama-4 and JetMoE convert (Fp8BmmExperts, Fp8ParallelExperts)."""
    from transformers import (
        JetMoeConfig,
        JetMoeForCausalLM,
        LongcatFlashConfig,
        LongcatFlashForCausalLM,
        MambaConfig,
        MambaForCausalLM,
        XLNetConfig,
        XLNetLMHeadModel,
    )
    from transformers.models.llama4.modeling_llama4 import Llama4ForCausalLM

    from hf_fp8.modules.selection import high_precision_parts

    mla = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8)
    with torch.device("meta"):
        xlnet = XLNetLMHeadModel(XLNetConfig(d_model=64, n_layer=1, n_head=4, d_inner=64))
        mamba = MambaForCausalLM(MambaConfig(hidden_size=32, num_hidden_layers=1))
        llama4 = Llama4ForCausalLM(Llama4TextConfig(**SMALL_MOE, num_hidden_layers=1))
        jetmoe = JetMoeForCausalLM(
            JetMoeConfig(hidden_size=32, num_hidden_layers=1, kv_channels=8, num_local_experts=4)
        )
        longcat = LongcatFlashForCausalLM(
            LongcatFlashConfig(
                hidden_size=32,
                num_layers=1,
                num_attention_heads=4,
                ffn_hidden_size=32,
                expert_ffn_hidden_size=16,
                n_routed_experts=4,
                zero_expert_num=2,
                moe_topk=2,
                v_head_dim=8,
                **mla,
            )
        )
    own = [g for g in high_precision_parts(xlnet) if "XLNetRelativeAttention" in g["why"]]
    assert own[0]["what"] == "parameters used by their module's own code"
    assert own[0]["parameters"] == 5 * 64 * 64  # q, k, v, o, r: [64, 4, 16] each
    kept = _parts(mamba)["linears kept in high precision"]
    assert kept["why"] == "MambaMixer reads its .weight directly"
    experts = _parts(longcat)["MoE experts not converted"]
    assert "LongcatFlashExperts is not built on" in experts["why"]
    # gate_up [6 (4 routed + 2 zero experts), 32, 32] and down [4, 32, 16]
    assert experts["parameters"] == 6 * 32 * 32 + 4 * 32 * 16
    assert "MoE experts not converted" not in _parts(llama4)
    assert "MoE experts not converted" not in _parts(jetmoe)
