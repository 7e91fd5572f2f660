"""R21 F3: ``torch.compile(fullgraph=True)`` of FP8 MoE models (``Fp8Experts``).

The eager grouped route sizes its tensors by how many rows each expert received (a host
sync), which dynamo cannot trace in one graph; under ``torch.compile`` the experts take a
static-shape route. Each test compiles a tiny MoE model with ``fullgraph=True`` and compares
its logits (and greedy tokens) with the same quantized model run eagerly.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
FAMILIES = {
    "qwen3_moe": (
        tf.Qwen3MoeConfig,
        tf.Qwen3MoeForCausalLM,
        dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    ),
    "mixtral": (
        tf.MixtralConfig,
        tf.MixtralForCausalLM,
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    ),
}
CONFIGS = {
    "weight_only": lambda: Fp8Config("weight_only"),
    "dynamic": lambda: Fp8Config("dynamic"),
    "dynamic/tensor": lambda: Fp8Config("dynamic", activation_granularity="tensor"),
    "static": lambda: Fp8Config("static", weight_granularity="tensor", activation_scale=0.05),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cache = {}

    def build(family: str) -> str:
        if family not in cache:
            config_cls, model_cls, extra = FAMILIES[family]
            torch.manual_seed(0)
            model = model_cls(config_cls(**{**_COMMON, **extra})).eval()
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = str(path)
        return cache[family]

    return build


def _load(path: str, family: str, config: str):
    model = FAMILIES[family][1].from_pretrained(path, quantization_config=CONFIGS[config]())
    model.eval()
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    return model


def _inputs(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=gen)


# Every family x config once, static and dynamic shapes alternating so that each family and
# each config meets both (every pair twice cost minutes of capture for no new route).
CAPTURES = [
    (family, config, (i + j) % 2 == 1)
    for i, family in enumerate(sorted(FAMILIES))
    for j, config in enumerate(sorted(CONFIGS))
]


@pytest.mark.parametrize(("family", "config", "dynamic"), CAPTURES)
def test_fp8_moe_model_captures_in_one_graph_like_eager(family, config, dynamic, moe_dir):
    """fullgraph=True with dynamo's eager backend (the capture is what failed), static or
    dynamic shapes, prefill and decode sizes: same logits as the eager quantized model."""
    model = _load(moe_dir(family), family, config)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="eager")
    for batch, seq in ((2, 10), (1, 1), (3, 17)):
        ids = _inputs(batch, seq, seed=seq)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            got = compiled(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    torch._dynamo.reset()


def test_expert_outside_the_range_adds_nothing_under_compile(moe_dir):
    """Expert-parallel sentinels (ids outside [0, E)) are dropped in the compiled route too."""
    model = _load(moe_dir("qwen3_moe"), "qwen3_moe", "dynamic")
    experts = next(m for m in model.modules() if isinstance(m, Fp8Experts))
    torch.manual_seed(1)
    x = torch.randn(6, 64)
    index = torch.tensor([[0, 1], [2, 7], [-1, 3], [1, 1], [3, 0], [4, 2]])
    weights = torch.rand(6, 2)
    # reference: the sentinel pairs removed by giving them weight zero on a valid expert
    valid = (index >= 0) & (index < 4)
    with torch.no_grad():
        expected = experts(x, index.clamp(0, 3), weights * valid)
        torch._dynamo.reset()
        got = torch.compile(experts, fullgraph=True, backend="eager")(x, index, weights)
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "config"), [("qwen3_moe", "dynamic"), ("mixtral", "weight_only")]
)
def test_fp8_moe_model_compiles_with_inductor_and_generates_like_eager(family, config, moe_dir):
    """The README's form: torch.compile(model.forward, fullgraph=True) with inductor; the
    prefill and one cached decode step (each new shape is one more inductor compile)."""
    model = _load(moe_dir(family), family, config)
    ids = _inputs(1, 8)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        eager_logits = model(input_ids=ids).logits
        eager_tokens = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False
        )
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        compiled_logits = model(input_ids=ids).logits
        compiled_tokens = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False
        )
    torch._dynamo.reset()
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-3, atol=1e-3)
    assert torch.equal(compiled_tokens, eager_tokens)
