"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def mxfp8_quantize(*args, **kwargs):
    raise NotImplementedError('mxfp8_quantize')


def validate_mxfp8_quantize(*args, **kwargs):
    pass


def mxfp8_dequantize(*args, **kwargs):
    raise NotImplementedError('mxfp8_dequantize')


def validate_mxfp8_dequantize(*args, **kwargs):
    pass

