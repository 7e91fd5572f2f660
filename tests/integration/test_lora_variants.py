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
