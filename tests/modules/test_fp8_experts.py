"""``Fp8Experts`` against the experts module it replaces, for every experts class of transformers.

References: the source class's own (eager) forward on the dequantized weights in fp32, and for
FP8 activations a per-expert loop here that fake-quantizes each projection's input with the
numerics functions before multiplying by the dequantized weight.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import (
    Fp8Experts,
    bytes_per_parameter,
    config_recipe,
    experts_layout,
    quantize_projection,
    unsupported_reason,
)
from hf_fp8.numerics import dequantize, quantize_weight, quantize_with_scale
from hf_fp8.recipe import Fp8Recipe
from tests.kernels.reference import fake_quant
from tests.modules.moe_zoo import build_tiny, experts_classes, routed_inputs

grouped = importlib.import_module("hf_fp8.kernels.grouped")
grouped_cpu = importlib.import_module("hf_fp8.kernels.grouped_cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CLASSES = experts_classes()
# Families of the issue, one per layout feature: plain, gpt-oss (transposed + bias +
# interleaved gate_up + own _apply_gate), no gate (NemotronH), post-expert norm (MuseSpark).
FAMILIES = {
    c.__name__: c
    for c in CLASSES
    if c.__name__
    in (
        "Qwen3MoeExperts",
        "MixtralExperts",
        "OlmoeExperts",
        "GptOssExperts",
        "DeepseekV3Experts",
        "NemotronHExperts",
        "MuseSparkExperts",
    )
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_discovery_finds_the_experts_classes_of_transformers() -> None:
    assert len(CLASSES) >= 60
    assert len(FAMILIES) == 7


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_experts_class_converts_and_matches_its_eager_forward(cls) -> None:
    """Weight-only FP8 experts equal the source class's forward on the dequantized weights."""
    source = build_tiny(cls)
    reason = unsupported_reason(source)
    assert reason is None, f"{cls.__name__} is refused: {reason}"
    fp8 = Fp8Experts.from_experts(source, Fp8Config("weight_only"), module_name="mlp.experts")
    back = fp8.dequantize()
    assert type(back) is cls
    assert {n: p.shape for n, p in back.named_parameters()} == {
        n: p.shape for n, p in source.named_parameters()
    }
    layout = experts_layout(source)
    x, index, weights = routed_inputs(layout.hidden_size, layout.num_experts)
    with torch.no_grad():
        expected = back(x, index, weights)
        got = fp8(x, index, weights)
    assert _rel(got, expected) < 1e-5


def _fake(a: torch.Tensor, scheme: str, a_gran: str | None, scale, dtype, block_k: int):
    if scheme == "weight_only":
        return a
    if scheme == "static":
        s = scale.reshape(1)
        return dequantize(quantize_with_scale(a, s, dtype, "tensor"), s)
    return fake_quant(a, a_gran, block_k, dtype=dtype)


def _reference(fp8: Fp8Experts, source: nn.Module, x, index, weights) -> torch.Tensor:
    """Per-expert fp32 loop: fake-quantized inputs times the dequantized expert weights."""
    layout = fp8.layout
    out = torch.zeros_like(x)
    for e in index.unique().tolist():
        token, pos = (index == e).nonzero(as_tuple=True)
        h = x[token]
        for proj in layout.projections:
            w = dequantize(
                getattr(fp8, proj)[e],
                getattr(fp8, f"{proj}_weight_scale")[e],
                torch.float32,
                fp8.weight_granularity,
                fp8.block_size,
            )
            scale = getattr(fp8, f"{proj}_input_scale")
            a = _fake(h, fp8.activation_scheme, fp8.activation_granularity,
                      None if scale is None else scale[e], w_dtype(fp8), fp8.block_size[1])  # fmt: skip
            h = a @ w.T
            if layout.has_bias:
                h = h + getattr(fp8, f"{proj}_bias")[e]
            if proj != "down_proj":
                h = type(source)._apply_gate(source, h) if layout.has_gate else source.act_fn(h)
        if layout.has_post_expert_norm:
            h = source.post_expert_norm(h)
        out.index_add_(0, token, h * weights[token, pos, None])
    return out


def w_dtype(fp8: Fp8Experts) -> torch.dtype:
    return getattr(fp8, fp8.layout.up_name).dtype


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("scheme", ["dynamic", "static", "weight_only"])
@pytest.mark.parametrize(
    ("gran", "fmt"), [("row", "e4m3"), ("tensor", "e4m3"), ("block", "e4m3"), ("row", "e5m2")]
)
def test_schemes_granularities_formats_match_the_reference(name, scheme, gran, fmt) -> None:
    source = build_tiny(FAMILIES[name])
    config = Fp8Config(
        scheme,
        weight_granularity=gran,
        fp8_format=fmt,
        block_size=(16, 16),
        activation_scale=0.02 if scheme == "static" else None,
    )
    fp8 = Fp8Experts.from_experts(source, config)
    layout = fp8.layout
    x, index, weights = routed_inputs(layout.hidden_size, layout.num_experts, tokens=11)
    with torch.no_grad():
        got = fp8(x, index, weights)
        ref = _reference(fp8, source, x, index, weights)
        exact = source(x, index, weights)
    assert _rel(got, ref) < 1e-5
    if scheme != "static":  # a fixed static scale may saturate; dynamic ones fit the data
        assert _rel(got, exact) < (0.3 if fmt == "e5m2" else 0.12)


@pytest.mark.parametrize("name", ["Qwen3MoeExperts", "GptOssExperts"])
@pytest.mark.parametrize(
    ("scheme", "a_gran"), [("dynamic", "token"), ("dynamic", "tensor"), ("static", None),
                           ("weight_only", None)]
)  # fmt: skip
@pytest.mark.parametrize("gran", ["row", "block"])
def test_many_rows_per_expert_match_the_reference(name, scheme, a_gran, gran) -> None:
    """Prefill-sized groups (every expert above the CPU GEMV limit, tokens of very different
    magnitudes): each token's own scale, each expert's own group / static scale."""
    source = build_tiny(FAMILIES[name])
    config = Fp8Config(
        scheme,
        weight_granularity=gran,
        activation_granularity=a_gran,
        block_size=(16, 16),
        activation_scale=0.05 if scheme == "static" else None,
    )
    fp8 = Fp8Experts.from_experts(source, config)
    layout = fp8.layout
    x, index, weights = routed_inputs(layout.hidden_size, layout.num_experts, tokens=96)
    x = x * torch.logspace(-2, 2, 96).unsqueeze(-1)
    with torch.no_grad():
        got = fp8(x, index, weights)
        ref = _reference(fp8, source, x, index, weights)
        assert _rel(got, ref) < 1e-5
        fp8.to(torch.bfloat16)
        xb = x.bfloat16()
        got16 = fp8(xb, index, weights.bfloat16())
        ref16 = _reference(fp8, source, xb.float(), index, weights.bfloat16().float())
    assert got16.dtype == torch.bfloat16 and _rel(got16, ref16) < 2e-2


def test_each_expert_has_its_own_scales() -> None:
    source = build_tiny(FAMILIES["GptOssExperts"])
    with torch.no_grad():
        source.down_proj[2] *= 1000  # one loud expert must not coarsen the others
    for gran in ("tensor", "row", "block"):
        fp8 = Fp8Experts.from_experts(source, Fp8Config("dynamic", weight_granularity=gran,
                                                        block_size=(16, 16)))  # fmt: skip
        for e in range(fp8.num_experts):
            codes, scale = quantize_weight(source.down_proj[e].detach().T, E4M3, gran, (16, 16))
            assert torch.equal(fp8.down_proj[e].view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(fp8.down_proj_weight_scale[e], scale)
        assert fp8.down_proj.shape == (
            fp8.num_experts,
            32,
            24,
        )  # [E, out, in] (source: [E, in, out])


def test_quantize_projection_names_the_expert() -> None:
    """The load-time entry (a merged ``[E, ...]`` checkpoint tensor in the source layout)."""
    source = build_tiny(FAMILIES["GptOssExperts"])
    layout, recipe = experts_layout(source), Fp8Recipe.resolve()
    codes, scales = quantize_projection(source.down_proj.detach(), layout, recipe)
    fp8 = Fp8Experts.from_experts(source)
    assert torch.equal(codes.view(torch.uint8), fp8.down_proj.view(torch.uint8))
    assert torch.equal(scales, fp8.down_proj_weight_scale)
    bad = source.down_proj.detach().clone()
    bad[3, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj\[expert 3\]"):
        quantize_projection(bad, layout, recipe, name="layers.1.mlp.experts.down_proj")
    with pytest.raises(ValueError, match=r"must be \[6, \.\.\.\]"):
        quantize_projection(bad[:2], layout, recipe)


def test_only_routed_experts_compute(monkeypatch) -> None:
    """Two matmuls per expert present, none for the others (even with NaN weights)."""
    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("dynamic"))
    with torch.no_grad():
        fp8.gate_up_proj[4] = float("nan")
        fp8.down_proj[4] = float("nan")
    calls = []
    real = grouped.fp8_linear

    def spy(x, w, *a, **k):
        calls.append(x.shape[0])
        return real(x, w, *a, **k)

    monkeypatch.setattr(grouped, "fp8_linear", spy)
    monkeypatch.setattr(grouped_cpu, "fp8_linear", spy)  # the CPU route's small experts
    x = torch.randn(5, 32)
    index = torch.tensor([[0, 1], [1, 0], [0, 3], [3, 1], [1, 0]])
    out = fp8(x, index, torch.full((5, 2), 0.5))
    assert sorted(calls) == [2, 2, 4, 4, 4, 4]  # experts 0, 1 (4 rows each) and 3 (2 rows)
    assert torch.isfinite(out).all()


def test_expert_parallel_sentinels_contribute_nothing() -> None:
    source = build_tiny(FAMILIES["MixtralExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("weight_only"))
    x = torch.randn(3, 32)
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.3, 0.7]])
    with_sentinel = fp8(x, torch.tensor([[0, 1], [2, 6], [1, 3]]), weights)
    expected = fp8(x, torch.tensor([[0, 1], [2, 5], [1, 3]]), weights)
    torch.testing.assert_close(with_sentinel, expected)


def test_forward_takes_the_source_keyword_names() -> None:
    source = build_tiny(FAMILIES["GptOssExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("weight_only"))
    x, index, weights = routed_inputs(32, 6)
    positional = fp8(x, index, weights)
    torch.testing.assert_close(fp8(x, router_indices=index, routing_weights=weights), positional)
    with pytest.raises(TypeError, match="router_indices, routing_weights"):
        fp8(x, index, weights, bogus=index)


def test_experts_implementation_choice(monkeypatch) -> None:
    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("weight_only"))
    x, index, weights = routed_inputs(32, 6)
    outs = []
    for impl in ("eager", "grouped_mm", "batched_mm"):
        fp8.config._experts_implementation = impl
        outs.append(fp8(x, index, weights))
    assert all(torch.equal(o, outs[0]) for o in outs)
    fp8.config._experts_implementation = "deepgemm"
    with pytest.raises(NotImplementedError, match=r"set_experts_implementation\('grouped_mm'\)"):
        fp8(x, index, weights)


def test_refusals_name_what_is_missing() -> None:
    from transformers.models.llama4 import modeling_llama4

    llama4 = modeling_llama4.Llama4TextExperts(
        modeling_llama4.Llama4TextConfig(hidden_size=32, intermediate_size=24, num_local_experts=4)
    )
    assert "use_experts_implementation" in unsupported_reason(llama4)
    assert experts_layout(llama4) is None
    assert experts_layout(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match=r"cannot convert layers\.0\.experts: .*Llama4TextExperts"):
        Fp8Experts.from_experts(llama4, module_name="layers.0.experts")

    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    fp8 = Fp8Experts.from_experts(source)
    assert "already FP8" in unsupported_reason(fp8)
    source.extra = nn.Parameter(torch.zeros(3))
    assert "'extra'" in unsupported_reason(source)
    del source.extra
    source.register_buffer("counts", torch.zeros(3))
    assert "'counts'" in unsupported_reason(source)
    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    source.gate_up_proj = nn.Parameter(source.gate_up_proj.detach().to(E4M3))
    assert "not a high-precision float" in unsupported_reason(source)
    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    source._is_expert_parallel = True
    assert "expert parallelism" in unsupported_reason(source)


@pytest.mark.parametrize(
    ("family", "cls_name", "config_name"),
    [
        ("dbrx", "DbrxExperts", "DbrxFFNConfig"),
        ("longcat_flash", "LongcatFlashExperts", "LongcatFlashConfig"),
    ],
)
def test_experts_outside_the_interface_are_refused(family, cls_name, config_name) -> None:
    """Experts classes of 5.24 not built on use_experts_implementation (built on meta)."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    configuration = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    with torch.device("meta"):
        module = getattr(modeling, cls_name)(getattr(configuration, config_name)())
    assert experts_layout(module) is None
    assert "not built on transformers.integrations.moe" in unsupported_reason(module)
    with torch.device("meta"):
        jetmoe = importlib.import_module("transformers.models.jetmoe.modeling_jetmoe")
        assert "lacks the layout flags" in unsupported_reason(jetmoe.JetMoeParallelExperts(4, 8, 8))
        step = importlib.import_module("transformers.models.step3p7.modeling_step3p7")
        config = types.SimpleNamespace(
            num_local_experts=4, hidden_size=8, moe_intermediate_size=4, hidden_act="silu"
        )
        assert "lacks the layout flags" in unsupported_reason(step.Step3p7Experts(config))


def test_transformers_own_fp8_experts_are_refused() -> None:
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    config = build_tiny(FAMILIES["Qwen3MoeExperts"]).config
    cls = use_experts_implementation(FP8Experts)
    module = cls(config, block_size=(16, 16))
    assert "high-precision" in unsupported_reason(module)


def test_static_scales_per_projection_and_errors() -> None:
    source = build_tiny(FAMILIES["OlmoeExperts"])
    config = Fp8Config("static", activation_scale=0.05,
                       activation_scales={"mlp.experts.down_proj": 0.2})  # fmt: skip
    fp8 = Fp8Experts.from_experts(source, config, module_name="mlp.experts")
    assert torch.equal(fp8.gate_up_proj_input_scale, torch.full((6,), 0.05))
    assert torch.equal(fp8.down_proj_input_scale, torch.full((6,), 0.2))
    fp8.set_input_scale("down_proj", torch.arange(1.0, 7.0))
    assert fp8.down_proj_input_scale.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    with pytest.raises(ValueError, match="positive finite"):
        fp8.set_input_scale("down_proj", torch.tensor([1.0, 0, 1, 1, 1, 1]))
    uncalibrated = Fp8Experts.from_experts(source, Fp8Config("static"))
    with pytest.raises(RuntimeError, match="calibrate"):
        uncalibrated(*routed_inputs(32, 6))
    with pytest.raises(ValueError, match="only used by activation_scheme='static'"):
        Fp8Experts.from_experts(source).set_input_scale("down_proj", 1.0)


def test_dtype_casts_keep_codes_and_scales() -> None:
    source = build_tiny(FAMILIES["GptOssExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("dynamic"))
    x, index, weights = routed_inputs(32, 6)
    out32 = fp8(x, index, weights)
    codes = fp8.gate_up_proj.clone()
    fp8.to(torch.bfloat16)
    assert fp8.compute_dtype == torch.bfloat16 and fp8.gate_up_proj.dtype == E4M3
    assert fp8.gate_up_proj_weight_scale.dtype == torch.float32
    assert fp8.down_proj_bias.dtype == torch.bfloat16
    assert torch.equal(fp8.gate_up_proj.view(torch.uint8), codes.view(torch.uint8))
    out16 = fp8(x.bfloat16(), index, weights.bfloat16())
    assert out16.dtype == torch.bfloat16 and _rel(out16, out32) < 0.05


def test_recipe_is_the_configs() -> None:
    source = build_tiny(FAMILIES["MixtralExperts"])
    config = Fp8Config("dynamic", weight_granularity="block", fp8_format="e5m2")
    fp8 = Fp8Experts.from_experts(source, config)
    assert fp8.recipe == Fp8Recipe.resolve("dynamic", weight_granularity="block", fp8_format="e5m2")
    assert (fp8.activation_granularity, fp8.block_size, fp8.kernel) == ("block", (128, 128), "auto")
    assert Fp8Experts.from_experts(source).recipe == Fp8Recipe.resolve()
    with pytest.raises(TypeError, match="Fp8Recipe"):
        Fp8Experts(fp8.layout, "dynamic")


def test_meta_construction_matches_from_experts() -> None:
    """What the quantizer builds before loading has the storage ``from_experts`` fills."""
    source = build_tiny(FAMILIES["GptOssExperts"])
    with torch.device("meta"):
        meta_source = type(source)(source.config)
    for scheme, gran in [("dynamic", "row"), ("static", "tensor"), ("weight_only", "block")]:
        config = Fp8Config(scheme, weight_granularity=gran, block_size=(16, 16),
                           activation_scale=1.0 if scheme == "static" else None)  # fmt: skip
        real = Fp8Experts.from_experts(source, config, module_name="m.experts")
        meta = Fp8Experts.empty_like(meta_source, config, module_name="m.experts")
        assert meta.gate_up_proj.is_meta
        assert {n: (p.shape, p.dtype) for n, p in meta.named_parameters()} == {
            n: (p.shape, p.dtype) for n, p in real.named_parameters()
        }
        assert meta.alpha == real.alpha == source.alpha  # what _apply_gate reads
        assert all(not p.requires_grad for n, p in real.named_parameters() if "bias" not in n)
        direct = Fp8Experts(experts_layout(source), config_recipe(config), device="meta")
        assert {n for n, _ in direct.named_parameters()} <= {n for n, _ in real.named_parameters()}


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_state_dict_round_trip_is_bit_exact(scheme) -> None:
    source = build_tiny(FAMILIES["GptOssExperts"])
    config = Fp8Config(scheme, activation_scale=0.05 if scheme == "static" else None)
    fp8 = Fp8Experts.from_experts(source, config)
    if scheme == "static":
        fp8.set_input_scale("down_proj", torch.arange(1.0, 7.0))
    state = fp8.state_dict()
    fresh = Fp8Experts.empty_like(source, Fp8Config(scheme))  # no input scales yet
    fresh.load_state_dict(state, strict=True)
    for key, tensor in state.items():
        assert torch.equal(fresh.state_dict()[key].view(torch.uint8), tensor.view(torch.uint8))
    x, index, weights = routed_inputs(32, 6)
    assert torch.equal(fresh(x, index, weights), fp8(x, index, weights))
    high = {**state, "down_proj": source.down_proj.detach()}
    with pytest.raises(ValueError, match=r"down_proj is torch\.float32, not fp8.*from_experts"):
        fresh.load_state_dict(high)


@pytest.mark.parametrize("name", ["Qwen3MoeExperts", "GptOssExperts"])
def test_gradients_reach_the_hidden_states_and_biases(name) -> None:
    """Straight-through: the input (and bias) gradients of the dequantized source module."""
    source = build_tiny(FAMILIES[name])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("weight_only"))
    back = fp8.dequantize()
    for proj in fp8.layout.projections:
        getattr(back, proj).requires_grad_(False)
    x, index, weights = routed_inputs(32, 6)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    fp8(x1, index, weights).square().sum().backward()
    back(x2, index, weights).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    assert not any(p.requires_grad for p in fp8._frozen())
    if fp8.layout.has_bias:
        for proj in fp8.layout.projections:
            got, expected = getattr(fp8, f"{proj}_bias").grad, getattr(back, f"{proj}_bias").grad
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_bytes_per_expert_parameter_with_row_scales() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = FAMILIES["Qwen3MoeExperts"]
    assert cfg is Qwen3MoeExperts
    source = build_tiny(Qwen3MoeExperts)
    with torch.device("meta"):
        layout = experts_layout(source)
    wide = type(layout)(**{**layout.__dict__, "hidden_size": 2048, "intermediate_size": 768})
    with torch.device("meta"):
        fp8 = Fp8Experts(wide)
    assert bytes_per_parameter(fp8) <= 1.01


_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                      eos_token_id=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                     layer_types=["full_attention"] * 2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                         n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16)),
}  # fmt: skip


def _swap(model: nn.Module, make) -> int:
    swapped = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Experts) or experts_layout(module) is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, make(module, name))
            swapped += 1
    return swapped


@pytest.mark.parametrize("family", sorted(MODELS))
def test_whole_model_with_fp8_experts(family) -> None:
    """The model's own routing calls the swapped experts (default experts implementation):
    logits equal the dequantized model's (weight-only) and stay close with dynamic FP8."""
    import transformers

    config_name, model_name, extra = MODELS[family]
    config = getattr(transformers, config_name)(**{**_DECODER, **extra})
    model = getattr(transformers, model_name)(config).eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(ids).logits
    layers = _swap(model, lambda m, n: Fp8Experts.from_experts(m, Fp8Config("weight_only"),
                                                               module_name=n))  # fmt: skip
    assert layers >= 1
    with torch.no_grad():
        got = model(ids).logits
    _swap(model, lambda m, n: m.dequantize())
    with torch.no_grad():
        reference = model(ids).logits
    assert _rel(got, reference) < 1e-5
    _swap(model, lambda m, n: Fp8Experts.from_experts(m, Fp8Config("dynamic"), module_name=n))
    with torch.no_grad():
        dynamic = model(ids).logits
    assert _rel(dynamic, exact) < 0.1


def test_requires_grad_on_fp8_expert_codes_is_refused_with_the_fix() -> None:
    """``requires_grad_(True)`` on an FP8 experts module made its codes and scales look
    trainable while no gradient reached them (silently nothing trained)."""
    from hf_fp8.modules import freeze_fp8

    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("dynamic"))
    x, index, weights = routed_inputs(32, 6)
    with torch.no_grad():
        expected = fp8(x, index, weights)
    fp8.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"gate_up_proj has requires_grad=True.*freeze_fp8"):
        fp8(x, index, weights)
    assert freeze_fp8(fp8) == 4  # two projections' codes and scales
    x.requires_grad_(True)
    out = fp8(x, index, weights)
    out.sum().backward()
    assert x.grad is not None and fp8.gate_up_proj.grad is None
    # grad mode takes the emulation, no_grad the C route: equal up to fp32 reassociation
    torch.testing.assert_close(out.detach(), expected)
