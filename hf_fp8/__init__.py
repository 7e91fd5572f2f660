"""hf-fp8: FP8 inference and FP8-state training for the Hugging Face stack."""

from hf_fp8.config import Fp8Config
from hf_fp8.modules import Fp8Linear, quantize_model

__version__ = "0.1.0"

__all__ = ["Fp8Config", "Fp8Linear", "__version__", "quantize_model"]
