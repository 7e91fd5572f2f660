"""torch.compile: quantized models compile with fullgraph=True and match eager."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.kernels import cpu_kernel
from tests.tiny_models import VOCAB, model_inputs

LENGTHS = (3, 9, 20, 33, 57)  # five prompt lengths, both sides of the 16-token GEMV limit

CONFIGS = {
    "dynamic/row": Fp8Config("dynamic"),
    "dynamic/block": Fp8Config("dynamic", weight_granularity="block"),
    "static/tensor": Fp8Config("static", weight_granularity="tensor", activation_scale=0.05),
    "weight_only/row": Fp8Config("weight_only"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_fp8_linear_has_no_graph_breaks(name, dynamic):
    """Prefill-sized and decode-sized inputs (≤ 16 tokens take the C GEMV kernel, a custom
    op), with static and dynamic shapes: one graph each, same numbers as eager."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 48).to(torch.bfloat16), CONFIGS[name])
    for shape in ((2, 5, 64), (1, 1, 64), (1, 3, 64)):
        x = torch.randn(shape, dtype=torch.bfloat16)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(layer)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), layer(x), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dynamic/row", "weight_only/row"])
def test_quantized_model_compiles_fullgraph_and_generates_like_eager(name, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=CONFIGS[name]
    )
    inputs = model_inputs("llama", batch=1, seq=8)
    with torch.no_grad():
        eager_logits = model(**inputs).logits
        eager_tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        compiled_logits = model(**inputs).logits
        compiled_tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-3, atol=1e-3)
    assert torch.equal(compiled_tokens, eager_tokens)


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("name", ["dynamic/row", "weight_only/row"])
def test_cpu_inference_compiles_nothing_for_any_prompt_length(name, tiny_model_dir, monkeypatch):
    """Cold start (issue 14): with the C kernels the CPU path runs no inductor at all (the
    first call costs what eager costs) and five prompt lengths compile no graph."""
    monkeypatch.setenv("HF_FP8_COMPILE", "1")  # the default outside the tests
    if cpu_kernel.active_path() is None:
        pytest.skip(f"no C kernel here: {cpu_kernel.failure('scalar')}")
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=CONFIGS[name]
    )
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for length in LENGTHS:
            ids = torch.randint(0, VOCAB, (1, length))
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)
    assert _graphs() == 0


@pytest.mark.parametrize("name", ["dynamic/row", "weight_only/row"])
def test_user_compile_with_dynamic_shapes_never_recompiles(name, tiny_model_dir):
    """torch.compile(dynamic=True, fullgraph=True) of the quantized model: one graph per side
    of the GEMV limit (<= 16 tokens, above) whatever the prompt length; counted with dynamo's
    eager backend (the guards, not the code generator, decide recompiles)."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=CONFIGS[name]
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    forward = torch.compile(model.forward, fullgraph=True, dynamic=True, backend="eager")
    with torch.no_grad():
        for length in LENGTHS:
            ids = torch.randint(0, VOCAB, (1, length))
            torch.testing.assert_close(forward(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert _graphs() == 2
    torch._dynamo.reset()
