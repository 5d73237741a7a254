"""Numbers fixed by SEMANTICS.md: element formats, block size, E8M0 bytes, MLA shapes."""
from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 32

E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MAX_FINITE = 254


@dataclass(frozen=True)
class ElemFormat:
    name: str
    max: float
    emax: int  # exponent of the largest normal, unbiased
    mbits: int  # stored mantissa bits
    inv_max_bits: int  # fp32 bits of RN_f32(1/max), the rceil multiplier
    numpy_dtype_name: str  # ml_dtypes name
    torch_dtype_name: str


E4M3 = ElemFormat("e4m3", 448.0, 8, 3, 0x3B124925, "float8_e4m3fn", "float8_e4m3fn")
E5M2 = ElemFormat("e5m2", 57344.0, 15, 2, 0x37924925, "float8_e5m2", "float8_e5m2")
ELEM_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}

# The NaN element code written by this project in both formats (SEMANTICS 1.4).
NAN_CODE = 0x7F

SCALE_MODES = ("rceil", "floor", "ceil", "even")
NONFINITE_POLICIES = ("saturate", "nan_block")
SCALE_LAYOUTS = ("compact", "swizzled")

ROPE_STYLES = ("mla", "neox", "interleaved")
LAYOUTS = ("thd", "sbhd", "bshd")

# Swizzled (cuBLAS / cuDNN F8_128x4) tile of the scale matrix.
SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4

# DeepSeek-V3 MLA query path.
MLA_QK_HEAD_DIM = 192
MLA_V_HEAD_DIM = 128
MLA_NOPE_DIM = 128
MLA_ROPE_DIM = 64
MLA_Q_LORA_RANK = 1536
MLA_NUM_HEADS = 128

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
OUT_DTYPES = ("float32", "bfloat16")

OPS = (
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "swizzle_scales",
    "unswizzle_scales",
    "rope",
    "rope_backward",
    "mxfp8_gemm",
    "mla_q_uproj_rope_quant",
    "mla_q_uproj_rope_quant_backward",
    "rmsnorm_mxfp8",
    "rmsnorm_backward",
    "mla_kv_quantize",
    "mla_attention",
    "mla_attention_backward",
)
