"""peft LoRA variants and inits on an FP8 base equal the same adapter on the dequantized model.

BD-LoRA, VeLoRA and the orthogonal init build adapter tensors in the base weight's dtype (fp8
codes have no random / arithmetic kernels, and adapters must never be rounded to fp8); the others
must keep working too. Reference: the same peft flow on ``model.dequantize()``, which holds
exactly the weights the FP8 layers compute with (weight-only, fp32: equal up to summation order).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.config import BdLoraConfig, MontecloraConfig, VeloraConfig

from hf_fp8 import Fp8Linear
from tests.integration.test_lora_dora import _llama
from tests.tiny_models import model_inputs

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
INVOCATION = [7, 8, 9]  # aLoRA invocation tokens, put into every row of the batch

VARIANTS = {
    "bdlora": {
        "use_bdlora": BdLoraConfig(
            target_modules_bd_a=["q_proj", "up_proj"],
            target_modules_bd_b=["v_proj", "down_proj"],
            nblocks=2,
        )
    },
    "velora_random": {"velora_config": VeloraConfig(num_groups=4, init_type="random")},
    "velora_batch_average_once": {"velora_config": VeloraConfig(num_groups=4)},
    "velora_batch_average": {
        "velora_config": VeloraConfig(num_groups=4, init_type="batch_average")
    },
    "orthogonal": {"init_lora_weights": "orthogonal"},
    "gaussian": {"init_lora_weights": "gaussian"},
    "monteclora": {"monteclora_config": MontecloraConfig(num_samples=2)},
    "alora": {"alora_invocation_tokens": INVOCATION, "task_type": "CAUSAL_LM"},
}
# peft refuses to merge these on any base (per-token adapters)
NOT_MERGEABLE = {"alora"}


def _batch(name: str) -> dict:
    batch = model_inputs("llama")
    if name == "alora":
        batch["input_ids"][:, 3:6] = torch.tensor(INVOCATION)
    return batch


def _peft(tiny_model_dir, kind: str, name: str, dtype=torch.float32):
    model = _llama(tiny_model_dir, kind, dtype)  # (may build the tiny model, from its own seed)
    torch.manual_seed(0)  # the same adapter init for every kind
    model = get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, **VARIANTS[name]))
    torch.manual_seed(1)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_B" in key and not param.any():
                param.normal_(0, 0.05)  # stands for a trained adapter
    return model


def _adapter_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def _pair(tiny_model_dir, name: str, dtype=torch.float32):
    return [_peft(tiny_model_dir, kind, name, dtype) for kind in ("fp8", "dequantized")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", VARIANTS)
def test_adapter_init_matches_the_dequantized_model(tiny_model_dir, name, dtype):
    """Values and dtypes (peft upcasts bf16 adapter weights to fp32; buffers such as VeLoRA's
    projection keep the compute dtype, as on the dequantized model)."""
    fp8, reference = (_adapter_state(m) for m in _pair(tiny_model_dir, name, dtype))
    assert fp8.keys() == reference.keys() and fp8
    for key, value in reference.items():
        assert fp8[key].dtype == value.dtype and value.dtype != torch.float8_e4m3fn, key
        assert not key.endswith("weight") or value.dtype == torch.float32, key
        torch.testing.assert_close(fp8[key], value, rtol=1e-6, atol=0, msg=key)


@pytest.mark.parametrize("name", VARIANTS)
def test_training_step_matches_the_dequantized_model(tiny_model_dir, name):
    models = _pair(tiny_model_dir, name)
    batch = _batch(name)
    losses = []
    for model in models:
        model.train()
        torch.manual_seed(2)  # the same Monte Carlo samples in both models
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    fp8, reference = (
        {n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in models
    )
    assert fp8.keys() == reference.keys() and fp8
    assert all(grad is not None and grad.any() for grad in reference.values())
    for key, grad in reference.items():
        torch.testing.assert_close(fp8[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    # training-time state the forward wrote (VeLoRA's batch-average projection)
    for key, value in _adapter_state(models[1]).items():
        torch.testing.assert_close(_adapter_state(models[0])[key], value, rtol=1e-5, atol=1e-6)
    layer = models[0].base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.get_base_layer(), Fp8Linear)


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - NOT_MERGEABLE))
def test_merge_and_unmerge_match_the_dequantized_model(tiny_model_dir, name):
    fp8, reference = (m.eval() for m in _pair(tiny_model_dir, name))
    batch = _batch(name)
    with torch.no_grad():
        expected = reference(**batch).logits
        torch.testing.assert_close(fp8(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        layer = fp8.base_model.model.model.layers[0].self_attn.q_proj
        original = layer.get_base_layer()
        fp8.merge_adapter()
        assert type(layer.get_base_layer()) is torch.nn.Linear
        torch.testing.assert_close(fp8(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        fp8.unmerge_adapter()
        assert layer.get_base_layer() is original
        torch.testing.assert_close(fp8(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        merged = fp8.merge_and_unload()
        reference_merged = reference.merge_and_unload()
        for key, module in reference_merged.named_modules():
            if isinstance(module, torch.nn.Linear) and key.split(".")[-1] in TARGETS:
                torch.testing.assert_close(
                    merged.get_submodule(key).weight, module.weight, rtol=1e-5, atol=1e-6
                )
        torch.testing.assert_close(merged(**batch).logits, expected, rtol=1e-4, atol=1e-4)


def test_an_init_that_writes_the_dequantized_copy_is_refused(tiny_model_dir, monkeypatch):
    """The guard behind the list of known base-rewriting inits: OLoRA, taken off that list,
    subtracts its adapter from the dequantized copy, which would be lost; it is refused."""
    monkeypatch.setattr("hf_fp8.lora.REWRITING_INITS", ("pissa",))
    model = _llama(tiny_model_dir, "fp8")
    with pytest.raises(
        ValueError,
        match=r"'olora' \(LoRA variant: none\), rewrites the base weight.*quantize_model",
    ):
        get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="olora"))
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Fp8Linear)  # left as it was


def test_eva_init_matches_the_dequantized_model(tiny_model_dir):
    """EVA's ``lora_A`` comes from an SVD of the layer inputs (forward hooks on the FP8 model)."""
    from peft import EvaConfig, initialize_lora_eva_weights

    batches = [model_inputs("llama", batch=4, seq=12, seed=seed) for seed in range(4)]
    states = []
    for kind in ("fp8", "dequantized"):
        model = _llama(tiny_model_dir, kind)
        torch.manual_seed(0)
        config = LoraConfig(
            r=4, target_modules=TARGETS, init_lora_weights="eva", eva_config=EvaConfig(rho=1.0)
        )
        model = get_peft_model(model, config)
        initialize_lora_eva_weights(model, batches, show_progress_bar=False)
        states.append(_adapter_state(model))
    assert states[0].keys() == states[1].keys() and states[0]
    assert any("lora_A" in k and v.any() for k, v in states[1].items())
    for key, value in states[1].items():
        # singular vectors up to sign, from inputs equal up to summation order
        sign = torch.sign((states[0][key] * value).sum(dim=-1, keepdim=True)).clamp(min=0) * 2 - 1
        torch.testing.assert_close(states[0][key] * sign, value, rtol=1e-3, atol=1e-4, msg=key)


def test_arrow_routing_matches_the_dequantized_model(tiny_model_dir, tmp_path):
    """Arrow routes each token among task adapters (prototypes: a seeded power iteration on
    their lora_A/B; unseeded, two runs on the same model differ)."""
    from peft import ArrowConfig, create_arrow_model

    paths = []
    for task in range(2):
        model = get_peft_model(
            _llama(tiny_model_dir, "plain"), LoraConfig(r=4, target_modules=TARGETS)
        )
        torch.manual_seed(10 + task)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "lora_B" in key:
                    param.normal_(0, 0.05)
        model.save_pretrained(tmp_path / f"task{task}")
        paths.append(str(tmp_path / f"task{task}"))
    batch = model_inputs("llama")
    logits = []
    for kind in ("fp8", "dequantized"):
        model = create_arrow_model(
            _llama(tiny_model_dir, kind),
            paths,
            ArrowConfig(top_k=1, router_temperature=1.0, rng_seed=0),
        ).eval()
        with torch.no_grad():
            logits.append(model(**batch).logits)
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert "arrow_router" in layer.lora_arrow
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_a_refused_add_adapter_leaves_the_first_adapter(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("hf_fp8.lora.REWRITING_INITS", ("pissa",))
    model = get_peft_model(_llama(tiny_model_dir, "fp8"), LoraConfig(r=4, target_modules=TARGETS))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.get_base_layer()
    codes = base.weight.clone()
    with pytest.raises(ValueError, match=r"rewrites the base weight of .*q_proj"):
        model.add_adapter(
            "other", LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="olora")
        )
    assert set(layer.lora_A) == {"default"} and layer.get_base_layer() is base
    assert torch.equal(base.weight.view(torch.uint8), codes.view(torch.uint8))
    model(**model_inputs("llama"))  # still runs with the first adapter
