"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def mxfp8_gemm(*args, **kwargs):
    raise NotImplementedError('mxfp8_gemm')


def validate_mxfp8_gemm(*args, **kwargs):
    pass

