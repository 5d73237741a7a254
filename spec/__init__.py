"""mxmla's reference: NumPy + ml_dtypes definitions of every op, bit-exact where SEMANTICS.md fixes bytes.

No torch and no dispatcher here; everything else is judged against these functions.
"""
from .constants import OPS
from .mxtensor import MXTensor
from .quantize import mxfp8_dequantize, mxfp8_quantize, validate_mxfp8_dequantize, validate_mxfp8_quantize
from .swizzle import (
    pack_attention_scales,
    swizzle_scales,
    unswizzle_scales,
    validate_swizzle_scales,
    validate_unswizzle_scales,
)
from .rope import rope, rope_backward, validate_rope, validate_rope_backward
from .gemm import mxfp8_gemm, validate_mxfp8_gemm
from .mla_q import (
    mla_q_uproj_rope_quant,
    mla_q_uproj_rope_quant_backward,
    validate_mla_q_uproj_rope_quant,
    validate_mla_q_uproj_rope_quant_backward,
)
from .rmsnorm import rmsnorm_backward, rmsnorm_mxfp8, validate_rmsnorm_backward, validate_rmsnorm_mxfp8
from .mla_kv import mla_kv_quantize, validate_mla_kv_quantize
from .attention import (
    mla_attention,
    mla_attention_backward,
    validate_mla_attention,
    validate_mla_attention_backward,
)

# op name -> argument validator (same signature as the op; raises ValueError/TypeError naming the
# argument). The dispatcher runs these before any backend so every backend fails the same way.
VALIDATORS = {op: globals()[f"validate_{op}"] for op in OPS}

__all__ = ["OPS", "MXTensor", "VALIDATORS", "pack_attention_scales", *OPS]
