"""hf-fp8: FP8 inference and FP8-state training for the Hugging Face stack.

``import hf_fp8`` registers ``quant_method="hf_fp8"`` with transformers.
"""

import logging as _logging

# transformers' quantizer registry imports torchao when it is installed; its optional CUDA
# extensions log load failures on CPU machines. Quiet them during our import only.
_torchao_logger = _logging.getLogger("torchao")
_level = _torchao_logger.level
_torchao_logger.setLevel(_logging.ERROR)

from hf_fp8.calibration import calibrate
from hf_fp8.config import Fp8Config
from hf_fp8.modules import Fp8Linear, quantize_model
from hf_fp8.quantizer import Fp8HfQuantizer, register_with_transformers

register_with_transformers()
_torchao_logger.setLevel(_level)

__version__ = "0.1.0"

__all__ = ["Fp8Config", "Fp8HfQuantizer", "Fp8Linear", "__version__", "calibrate", "quantize_model"]
