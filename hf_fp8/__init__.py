"""hf-fp8: FP8 inference and FP8-state training for the Hugging Face stack.

``import hf_fp8`` registers ``quant_method="hf_fp8"`` with transformers.
"""

from hf_fp8._quiet import restore_logging
from hf_fp8.calibration import calibrate
from hf_fp8.config import Fp8Config
from hf_fp8.hub import attach_card_hooks, export, set_card_info
from hf_fp8.lora import register_peft_lora
from hf_fp8.modules import Fp8Linear
from hf_fp8.optim import AdamWFp8, register_trainer_optimizers
from hf_fp8.quantizer import Fp8HfQuantizer, quantize_model, register_with_transformers
from hf_fp8.quantizer.hf_quantizer import POST_LOAD_HOOKS
from hf_fp8.serialization import import_checkpoint, inspect_checkpoint

register_with_transformers()
register_peft_lora()
register_trainer_optimizers()  # TrainingArguments(optim="adamw_fp8_coat" | "adamw_fp8")
if attach_card_hooks not in POST_LOAD_HOOKS:
    POST_LOAD_HOOKS.append(attach_card_hooks)  # model cards on save_pretrained / push_to_hub
restore_logging()

__version__ = "0.1.0"

__all__ = [
    "AdamWFp8",
    "Fp8Config",
    "Fp8HfQuantizer",
    "Fp8Linear",
    "__version__",
    "calibrate",
    "export",
    "import_checkpoint",
    "inspect_checkpoint",
    "quantize_model",
    "set_card_info",
]
