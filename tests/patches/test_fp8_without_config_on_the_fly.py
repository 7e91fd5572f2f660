"""An FP8 checkpoint that lost its quantization_config, loaded with a third-party quantizer
that quantizes on the fly, is refused (reviewer R7 finding 1).

Before: the patch checked only loads without any quantizer. ``quantization_config=`` a
config transformers applies on the fly (``pre_quantized`` false: the folder's config has none
of its own) — ``FineGrainedFP8Config(dequantize=True)``, ``TorchAoConfig`` — read the fp8
codes as plain weights and dropped every ``weight_scale``: logits 1.43 off (relative) the
dequantized model. The same with ``from_pretrained(state_dict=...)``, which was not checked at
all. On-the-fly quantization of a high-precision checkpoint, and hf_fp8's own paths, are
unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config, LlamaForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import model_inputs, model_output


def _torchao_config():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


# (quant_method, config factory, relative error bound of the on-the-fly model vs the float one)
ON_THE_FLY = {
    "fp8": (lambda: FineGrainedFP8Config(dequantize=True), 1e-6),  # a no-op on the CPU
    "torchao": (_torchao_config, 0.02),  # int8 weight-only
}


@pytest.fixture(scope="module")
def lost_dir(llama_fp8_dir, tmp_path_factory) -> Path:
    """The saved hf_fp8 tiny Llama with ``quantization_config`` removed from its config.json."""
    folder = tmp_path_factory.mktemp("lost") / "ckpt"
    shutil.copytree(llama_fp8_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _rel(out, ref) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("method", sorted(ON_THE_FLY))
def test_on_the_fly_third_party_quantizer_on_a_lost_config_fp8_folder_is_refused(lost_dir, method):
    config = ON_THE_FLY[method][0]()
    with pytest.raises(
        CheckpointTensorError, match=r"^model\.layers\.\d\.[\w.]+\.weight in .*\(F8_E4M3\)"
    ) as err:
        AutoModelForCausalLM.from_pretrained(lost_dir, quantization_config=config)
    message = str(err.value)
    assert f"quant_method={method!r}, which quantizes on the fly" in message
    assert "restore" in message and "without quantization_config=" in message


@pytest.mark.parametrize("method", sorted(ON_THE_FLY))
def test_on_the_fly_quantization_of_a_float_checkpoint_is_untouched(tiny_model_dir, method):
    factory, bound = ON_THE_FLY[method]
    folder = tiny_model_dir("llama")
    inputs = model_inputs("llama")
    reference = model_output(AutoModelForCausalLM.from_pretrained(folder), inputs)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=factory())
    assert model.hf_quantizer.pre_quantized is False
    assert _rel(model_output(model, inputs), reference) <= bound


def test_an_unknown_saved_quant_method_with_an_on_the_fly_config_is_refused(lost_dir, tmp_path):
    """transformers skips a config.json quant_method it does not know; ``quantization_config=``
    then quantizes on the fly. The message names the saved quant_method."""
    folder = tmp_path / "modelopt"
    shutil.copytree(lost_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointTensorError, match=r"quant_method='fp8', which quantizes") as err:
        AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=FineGrainedFP8Config(dequantize=True)
        )
    assert "(quant_method='modelopt') that this load does not use" in str(err.value)


def test_hf_fp8_on_the_fly_config_keeps_its_own_refusal(lost_dir):
    """hf_fp8's Fp8Config refuses an FP8 checkpoint itself, per tensor; the patch leaves it."""
    with pytest.raises(CheckpointTensorError, match=r"on-the-fly Fp8Config"):
        AutoModelForCausalLM.from_pretrained(lost_dir, quantization_config=Fp8Config("dynamic"))


def test_fp8_state_dict_without_its_config_is_refused(llama_fp8_dir, tiny_model_dir):
    """``from_pretrained(None, config=base, state_dict=fp8_state_dict)`` was not checked."""
    fp8 = AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    base = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(CheckpointTensorError, match=r"in the state_dict= passed is FP8") as err:
        LlamaForCausalLM.from_pretrained(None, config=base, state_dict=fp8.state_dict())
    assert "quantization_config" in str(err.value)
    with pytest.raises(CheckpointTensorError, match=r"quant_method='fp8', which quantizes"):
        LlamaForCausalLM.from_pretrained(
            None,
            config=base,
            state_dict=fp8.state_dict(),
            quantization_config=FineGrainedFP8Config(dequantize=True),
        )


def test_state_dicts_that_carry_their_config_or_no_fp8_load(llama_fp8_dir, tiny_model_dir):
    inputs = model_inputs("llama")
    fp8 = AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    own = AutoConfig.from_pretrained(llama_fp8_dir)  # with its quantization_config
    loaded = LlamaForCausalLM.from_pretrained(None, config=own, state_dict=fp8.state_dict())
    assert _rel(model_output(loaded, inputs), model_output(fp8, inputs)) < 1e-6
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    plain = LlamaForCausalLM.from_pretrained(None, config=base.config, state_dict=base.state_dict())
    assert _rel(model_output(plain, inputs), model_output(base, inputs)) < 1e-6
