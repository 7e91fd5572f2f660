"""transformers integration: the registered ``Fp8HfQuantizer``."""

from hf_fp8.quantizer.convert import quantize_model
from hf_fp8.quantizer.hf_quantizer import Fp8HfQuantizer, Fp8QuantizeOp
from hf_fp8.quantizer.registration import register_with_transformers

__all__ = ["Fp8HfQuantizer", "Fp8QuantizeOp", "quantize_model", "register_with_transformers"]
