"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def swizzle_scales(*args, **kwargs):
    raise NotImplementedError('swizzle_scales')


def validate_swizzle_scales(*args, **kwargs):
    pass


def unswizzle_scales(*args, **kwargs):
    raise NotImplementedError('unswizzle_scales')


def validate_unswizzle_scales(*args, **kwargs):
    pass


def pack_attention_scales(*args, **kwargs):
    raise NotImplementedError('pack_attention_scales')

