"""FP8 optimizers: ``AdamWFp8`` (COAT) and the Trainer ``optim=`` names."""

from hf_fp8.optim._state_check import OptimizerStateError
from hf_fp8.optim.adamw_fp8 import AdamWFp8
from hf_fp8.optim.trainer_registry import register_trainer_optimizers

__all__ = ["AdamWFp8", "OptimizerStateError", "register_trainer_optimizers"]
