"""peft's ``low_cpu_mem_usage=True`` with DoRA or a non-plain init on an FP8 base (reviewer R30 F4).

Under peft's ``init_empty_weights`` the dequantized copy of the base that DoRA and such inits
are set up on was built on the meta device, and the check that the init left it unchanged
crashed (``aten::equal`` on meta tensors). Reference: the same flow on the dequantized model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs

VARIANTS = [{"use_dora": True}, {"init_lora_weights": "orthogonal"}]


def _fp8(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32, quantization_config=Fp8Config("weight_only")
    )


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits


def _config(extra) -> LoraConfig:
    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra)


@pytest.mark.parametrize("extra", VARIANTS, ids=["dora", "orthogonal"])
def test_adapter_loads_with_low_cpu_mem_usage_as_on_the_dequantized_base(
    tiny_model_dir, tmp_path, extra
):
    fp8 = _fp8(tiny_model_dir)
    dense = copy.deepcopy(fp8).dequantize()
    source = get_peft_model(copy.deepcopy(dense), _config(extra))  # trained in high precision
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in source.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    source.save_pretrained(tmp_path)

    reference = PeftModel.from_pretrained(dense, tmp_path, low_cpu_mem_usage=True)
    peft_model = PeftModel.from_pretrained(fp8, tmp_path, low_cpu_mem_usage=True)

    assert not any(p.is_meta for p in peft_model.parameters())
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.get_base_layer(), Fp8Linear)
    assert torch.equal(_logits(peft_model), _logits(reference))


@pytest.mark.parametrize("extra", VARIANTS, ids=["dora", "orthogonal"])
def test_get_peft_model_with_low_cpu_mem_usage_as_on_the_dequantized_base(tiny_model_dir, extra):
    fp8 = _fp8(tiny_model_dir)
    reference = get_peft_model(
        copy.deepcopy(fp8).dequantize(), _config(extra), low_cpu_mem_usage=True
    )
    peft_model = get_peft_model(fp8, _config(extra), low_cpu_mem_usage=True)
    meta = {n for n, p in peft_model.named_parameters() if p.is_meta}
    assert meta == {n for n, p in reference.named_parameters() if p.is_meta}
    assert meta and all("lora_" in n for n in meta)  # the adapters, to be loaded
    assert all(isinstance(m.get_base_layer(), Fp8Linear) for n, m in peft_model.named_modules()
               if n.endswith(("q_proj", "v_proj")))  # fmt: skip
