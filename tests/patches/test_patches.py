"""Each patch of another library fails alone: one warning that names the public way, and
``import hf_fp8`` / ``from_pretrained`` keep working. Subprocesses, because what a patch does
depends on import order."""

from __future__ import annotations

import importlib

import pytest

import _hf_fp8_autoload
from hf_fp8 import patches
from tests.patches.helpers import check, patch_warnings, run_python

# the names are removed before hf_fp8 registers, as with a transformers that lacks them
NO_AUTOLOAD = {"HF_FP8_AUTOLOAD": "0"}


def test_every_patch_module_has_a_step_for_each_of_its_triggers():
    for name, patch in patches.PATCHES.items():
        module = importlib.import_module(patch.module)
        assert set(module.TRIGGERS) == set(patch.triggers), name
        assert callable(module.apply), name
    # the .pth start-up hook watches what the quantizer patch is triggered by
    assert patches.PATCHES["quantizers"].triggers == _hf_fp8_autoload.QUANTIZER_TRIGGERS
    # ... and hooks the loader of every patch trigger from the start
    triggers = {step for patch in patches.PATCHES.values() for step in patch.triggers}
    assert set(_hf_fp8_autoload.PATCH_TRIGGERS) == triggers


def test_trainer_names_exist_right_after_import_hf_fp8_in_any_order():
    """The autoload imports hf_fp8 half-way through transformers.training_args: its names
    were added only at the next import, so TrainingArguments(optim=...) and --optim refused
    them right after `import hf_fp8` (R8 4)."""
    out = check(
        run_python(
            """
            from transformers import HfArgumentParser, TrainingArguments
            import hf_fp8
            args = TrainingArguments("unused_out", optim="adamw_fp8_coat")
            (parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
                ["--output_dir", "unused_out", "--optim", "adamw_fp8"]
            )
            print(args.optim.value, parsed.optim.value)
            """
        )
    )
    assert out.split() == ["adamw_fp8_coat", "adamw_fp8"]


def test_import_hf_fp8_imports_neither_torch_nor_transformers():
    out = check(
        run_python(
            """
            import sys
            import hf_fp8
            print(sorted(m for m in ("torch", "transformers", "peft", "huggingface_hub")
                         if m in sys.modules))
            print(hf_fp8.patches.status())
            """
        )
    )
    assert out.splitlines()[0] == "[]"
    assert "'quantizers': 'pending'" in out


def test_public_names_load_lazily():
    import hf_fp8

    for name in hf_fp8.__all__:
        assert getattr(hf_fp8, name) is not None, name
    assert set(hf_fp8.__all__) <= set(dir(hf_fp8))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_fp8.nope  # noqa: B018


@pytest.mark.slow
def test_missing_optimizer_handlers_disable_only_the_trainer_names():
    result = run_python(
        """
        import transformers.trainer_optimizer as trainer_optimizer
        del trainer_optimizer._OPTIMIZER_HANDLERS
        import hf_fp8
        from transformers import TrainingArguments
        TrainingArguments(output_dir="/tmp/unused", optim="adamw_torch", report_to=[])
        print(hf_fp8.patches.status()["trainer_optimizers"])
        print(hf_fp8.Fp8Config("dynamic").quant_method)
        """,
        env=NO_AUTOLOAD,  # the autoload would patch the module as its import ends, before del
    )
    out = check(result)
    (warning,) = patch_warnings(result.stderr)
    assert (
        "optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8" in warning and "_OPTIMIZER_HANDLERS" in warning
    )
    assert out.splitlines()[0].startswith("off: ")
    assert out.splitlines()[1] == "hf_fp8"


@pytest.mark.slow
def test_missing_upload_method_keeps_loading_and_the_card_on_save(tmp_path):
    """``_upload_modified_files`` renamed: from_pretrained and save (with card) work; one warning."""
    result = run_python(
        f"""
        HP, OUT = {str(tmp_path / "hp")!r}, {str(tmp_path / "fp8")!r}
        import transformers.utils.hub
        del transformers.utils.hub.PushToHubMixin._upload_modified_files  # PreTrainedModel's
        import hf_fp8
        from transformers import AutoModelForCausalLM
        from tests.tiny_models import TINY
        config_cls, model_cls, kwargs = TINY["llama"]
        model_cls(config_cls(**kwargs)).save_pretrained(HP)
        model = AutoModelForCausalLM.from_pretrained(HP, quantization_config=hf_fp8.Fp8Config("dynamic"))
        model.save_pretrained(OUT)
        model = AutoModelForCausalLM.from_pretrained(HP, quantization_config=hf_fp8.Fp8Config("dynamic"))
        print(hf_fp8.patches.status()["model_card"])
        """
    )
    out = check(result)
    (warning,) = patch_warnings(result.stderr)
    assert "_upload_modified_files" in warning and "hf_fp8.hub.push_folder" in warning
    assert out.strip().startswith("partly off: ")
    assert "hf_fp8" in (tmp_path / "fp8" / "README.md").read_text()


@pytest.mark.slow
def test_missing_registry_functions_leave_plain_loading_alone(tmp_path):
    result = run_python(
        f"""
        HP = {str(tmp_path / "hp")!r}
        import transformers.quantizers.auto as auto
        del auto.register_quantizer
        del auto.LOADING_ATTRIBUTES_CONFIG_TYPES
        import hf_fp8
        from transformers import AutoModelForCausalLM
        from tests.tiny_models import TINY
        config_cls, model_cls, kwargs = TINY["llama"]
        model_cls(config_cls(**kwargs)).save_pretrained(HP)
        model = AutoModelForCausalLM.from_pretrained(HP)  # a plain model loads as before
        model = hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"))  # the public way
        print(type(model.model.layers[0].mlp.up_proj).__name__)
        print(hf_fp8.patches.status()["quantizers"])
        """,
        env=NO_AUTOLOAD,
    )
    out = check(result)
    (warning,) = patch_warnings(result.stderr)
    assert "register_quantizer" in warning and "hf_fp8.quantize_model(model" in warning
    assert out.splitlines() == ["Fp8Linear", out.splitlines()[1]]
    assert out.splitlines()[1].startswith("off: ")


@pytest.mark.slow
def test_missing_peft_custom_modules_keep_lora_training():
    result = run_python(
        """
        import peft.tuners.lora.config as lora_config
        del lora_config.LoraConfig._register_custom_module
        import hf_fp8, torch
        from peft import LoraConfig, get_peft_model
        from tests.tiny_models import TINY, model_inputs
        config_cls, model_cls, kwargs = TINY["llama"]
        model = hf_fp8.quantize_model(model_cls(config_cls(**kwargs)), hf_fp8.Fp8Config("dynamic"))
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
        batch = model_inputs("llama")
        peft_model(**batch, labels=batch["input_ids"]).loss.backward()
        print(hf_fp8.patches.status()["peft_lora"])
        """
    )
    out = check(result)
    (warning,) = patch_warnings(result.stderr)
    assert "_register_custom_module" in warning and "model.dequantize()" in warning
    assert out.strip().startswith("off: ")


@pytest.mark.slow
def test_nothing_is_printed_on_import():
    """torchao (imported by transformers' quantizer registry) logs CUDA-extension failures and
    torch logs ``_pytree`` "Enum subclass" deprecations; hf_fp8 mutes both for that import."""
    result = run_python(
        """
        import hf_fp8
        import transformers.modeling_utils
        import peft
        from transformers import Trainer
        hf_fp8.Fp8Config, hf_fp8.Fp8Linear, hf_fp8.calibrate, hf_fp8.AdamWFp8
        print(sorted(set(hf_fp8.patches.status().values())), len(hf_fp8.patches.PATCHES))
        """,
        env={"PYTHONWARNINGS": ""},
    )
    assert check(result).strip() == f"['on'] {len(patches.PATCHES)}"
    assert result.stderr == ""


def test_half_and_float_stay_transformers_own_for_other_quantized_models():
    """The model_dtype patch only changes hf_fp8 models: any other quantized model still gets
    transformers' refusal."""
    result = run_python(
        """
        import hf_fp8, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2))
        model.is_quantized = True
        model.quantization_method = "bitsandbytes"
        try:
            model.half()
        except ValueError as exc:
            print("refused", "not supported for quantized model" in str(exc))
        print(hf_fp8.patches.status()["model_dtype"])
        """
    )
    assert check(result).split() == ["refused", "True", "on"]
