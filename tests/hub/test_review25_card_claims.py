"""R25 F3: a model card says only what holds for its model.

* the compressed-tensors export command appears only where ``hf-fp8 export`` accepts the
  model (not for e5m2, not for FP8 experts in a pair vLLM's fused-MoE loader refuses);
* ``vllm serve`` and "vLLM, SGLang, TGI ... load it as is" only where vLLM loads the export
  (not for block weights with static activations, not for weight-only FP8 experts), in the
  source's card and the export's (Format row and ``vllm`` tag too);
* static scales are "given or calibrated" (a given ``activation_scale`` is not calibrated);
* the Format row names ``input_scale`` only for static activations.

Each card is checked against what the exporter itself does with the same model (refuses,
warns that vLLM refuses, or neither): the reference is ``hf_fp8.export``, not the card code.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.hub import info_from_model, render_model_card

LLAMA_CASES = {
    # name: (Fp8Config kwargs, the export: "ok" | "no_vllm" | "refused")
    "dynamic-row": ({"activation_scheme": "dynamic"}, "ok"),
    "static-given-tensor": (
        {"activation_scheme": "static", "weight_granularity": "tensor", "activation_scale": 0.05},
        "ok",
    ),
    "static-block": (
        {
            "activation_scheme": "static",
            "weight_granularity": "block",
            "block_size": [32, 32],
            "activation_scale": 0.05,
        },
        "no_vllm",
    ),
    "e5m2": ({"activation_scheme": "dynamic", "fp8_format": "e5m2"}, "refused"),
    "weight_only": ({"activation_scheme": "weight_only"}, "ok"),
}


def _export(src, out) -> tuple[str, str | None]:
    """What the exporter does with ``src``: ``("ok" | "no_vllm" | "refused", card text)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hf_fp8.export(src, out)
        except ValueError:
            return "refused", None
    verdict = "no_vllm" if any("vLLM" in str(w.message) for w in caught) else "ok"
    return verdict, (out / "README.md").read_text(encoding="utf-8")


def _load_part(card: str) -> str:
    return card.split("## How to load")[1]


def _check_hf_fp8_card(card: str, verdict: str, name: str) -> None:
    banner = card.split("## Quantization")[0]
    export_cmd = f"hf-fp8 export {name} --format compressed-tensors"
    if verdict == "refused":
        assert "hf-fp8 export" not in card
        assert "vllm serve" not in card
    else:
        assert export_cmd in banner and export_cmd in _load_part(card)
    if verdict == "ok":
        assert "vllm serve" in _load_part(card)
        assert "vLLM, SGLang, TGI" in banner
    else:
        assert "vllm serve" not in card
        assert "vLLM, SGLang, TGI" not in card
        assert "vLLM does not load" in _load_part(card) or verdict == "refused"


def _check_ct_card(card: str, verdict: str) -> None:
    data = ModelCard(card).data.to_dict()
    fmt = next(line for line in card.splitlines() if line.startswith("| Format |"))
    if verdict == "ok":
        assert "vllm serve" in card and "vLLM, SGLang, TGI and" in card
        assert "vLLM" in fmt and "vllm" in data["tags"]
    else:
        assert "vllm serve" not in card and "vLLM, SGLang, TGI and" not in card
        assert "vLLM, SGLang" not in fmt and "not vLLM" in fmt and "vllm" not in data["tags"]
        assert "vLLM does not load it" in card
        assert "transformers" in fmt


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_cards_agree_with_the_exporter(case, tiny_model_dir, tmp_path):
    kwargs, expected = LLAMA_CASES[case]
    kwargs = dict(kwargs)
    config = Fp8Config(kwargs.pop("activation_scheme"), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32, quantization_config=config
    )
    src = tmp_path / "model-fp8"
    model.save_pretrained(src)
    card = (src / "README.md").read_text(encoding="utf-8")
    verdict, ct_card = _export(src, tmp_path / "model-ct")
    assert verdict == expected  # the reference: what hf-fp8 export does
    _check_hf_fp8_card(card, verdict, src.name)
    if ct_card is not None:
        _check_ct_card(ct_card, verdict)
    # Format row: input_scale only where activations are static
    fmt = next(line for line in card.splitlines() if line.startswith("| Format |"))
    assert ("input_scale" in fmt) == (config.activation_scheme == "static")
    # Scheme row: a given scale is not called calibrated
    scheme = next(line for line in card.splitlines() if line.startswith("| Scheme |"))
    if config.activation_scheme == "static":
        assert "given or calibrated" in scheme


def _moe(config: Fp8Config) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    c = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(c)
    hf_fp8.quantize_model(model, config)
    return model


MOE_CASES = {
    "weight_only": (Fp8Config("weight_only"), "no_vllm"),
    "dynamic-row": (Fp8Config("dynamic"), "ok"),
    "static-row": (Fp8Config("static", activation_scale=0.05), "refused"),
    "experts-kept": (Fp8Config("weight_only", modules_to_not_convert=["experts"]), "ok"),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_cards_agree_with_the_exporter(case, tmp_path):
    config, expected = MOE_CASES[case]
    model = _moe(config)
    src = tmp_path / "moe-fp8"
    model.save_pretrained(src)
    card = (src / "README.md").read_text(encoding="utf-8")
    verdict, ct_card = _export(src, tmp_path / "moe-ct")
    assert verdict == expected
    _check_hf_fp8_card(card, verdict, src.name)
    if ct_card is not None:
        _check_ct_card(ct_card, verdict)
    # the card rendered from the loaded model says the same as the one from the folder
    from_model = render_model_card(info_from_model(model), model_id=src.name)
    _check_hf_fp8_card(from_model, verdict, src.name)


def test_ct_card_import_line_needs_no_import(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32, quantization_config=Fp8Config("dynamic")
    )
    hf_fp8.export(model, tmp_path / "ct")
    card = (tmp_path / "ct" / "README.md").read_text(encoding="utf-8")
    assert "hf-fp8 import" in card
    assert "after `import hf_fp8`" not in card
    assert "HF_FP8_AUTOLOAD=0" in card
