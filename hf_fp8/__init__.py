"""hf-fp8: FP8 inference and FP8-state training for the Hugging Face stack.

``import hf_fp8`` is light: it imports neither torch nor transformers. It arranges for each
integration to be set up when the library it extends is imported (``hf_fp8.patches``):
``quant_method="hf_fp8"`` with transformers' quantizer registry, the Trainer's
``optim="adamw_fp8_coat"`` / ``"adamw_fp8"``, the model card on ``save_pretrained`` /
``push_to_hub`` of hf_fp8 models, and ``merge_and_unload`` for LoRA on FP8 layers. The public
names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hf_fp8 import patches as _patches

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "AdamWFp8": "hf_fp8.optim",
    "AlreadyQuantizedError": "hf_fp8.quantizer.convert",
    "CheckpointTensorError": "hf_fp8.numerics.checks",
    "Fp8Config": "hf_fp8.config",
    "Fp8HfQuantizer": "hf_fp8.quantizer",
    "Fp8Linear": "hf_fp8.modules",
    "calibrate": "hf_fp8.calibration",
    "export": "hf_fp8.serialization",
    "full_optimizer_state_dict_fp8": "hf_fp8.fsdp",
    "full_state_dict_fp8": "hf_fp8.fsdp",
    "fully_shard_fp8": "hf_fp8.fsdp",
    "ignore_fp8_for_ddp": "hf_fp8.ddp",
    "import_checkpoint": "hf_fp8.serialization",
    "inspect_checkpoint": "hf_fp8.serialization",
    "quantize_model": "hf_fp8.quantizer",
    "set_card_info": "hf_fp8.hub",
    "set_full_optimizer_state_dict_fp8": "hf_fp8.fsdp",
    "set_full_state_dict_fp8": "hf_fp8.fsdp",
    # kept for callers of earlier versions; not in __all__
    "attach_card_hooks": "hf_fp8.hub",
    "register_peft_lora": "hf_fp8.lora",
    "register_trainer_optimizers": "hf_fp8.optim",
    "register_with_transformers": "hf_fp8.quantizer",
}

__all__ = [
    "AdamWFp8",
    "AlreadyQuantizedError",
    "CheckpointTensorError",
    "Fp8Config",
    "Fp8HfQuantizer",
    "Fp8Linear",
    "__version__",
    "calibrate",
    "export",
    "full_optimizer_state_dict_fp8",
    "full_state_dict_fp8",
    "fully_shard_fp8",
    "ignore_fp8_for_ddp",
    "import_checkpoint",
    "inspect_checkpoint",
    "quantize_model",
    "set_card_info",
    "set_full_optimizer_state_dict_fp8",
    "set_full_state_dict_fp8",
]

if TYPE_CHECKING:
    from hf_fp8.calibration import calibrate
    from hf_fp8.config import Fp8Config
    from hf_fp8.ddp import ignore_fp8_for_ddp
    from hf_fp8.fsdp import (
        full_optimizer_state_dict_fp8,
        full_state_dict_fp8,
        fully_shard_fp8,
        set_full_optimizer_state_dict_fp8,
        set_full_state_dict_fp8,
    )
    from hf_fp8.hub import set_card_info
    from hf_fp8.modules import Fp8Linear
    from hf_fp8.numerics.checks import CheckpointTensorError
    from hf_fp8.optim import AdamWFp8
    from hf_fp8.quantizer import Fp8HfQuantizer, quantize_model
    from hf_fp8.quantizer.convert import AlreadyQuantizedError
    from hf_fp8.serialization import export, import_checkpoint, inspect_checkpoint


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")  # a subpackage: hf_fp8.hub
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'hf_fp8' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'hf_fp8' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


_patches.install()
