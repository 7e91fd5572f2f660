"""transformers integration: the registered ``Fp8HfQuantizer``."""

from hf_fp8.quantizer.hf_quantizer import Fp8HfQuantizer, Fp8QuantizeOp
from hf_fp8.quantizer.registration import register_with_transformers

__all__ = ["Fp8HfQuantizer", "Fp8QuantizeOp", "register_with_transformers"]
