"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def mla_attention(*args, **kwargs):
    raise NotImplementedError('mla_attention')


def validate_mla_attention(*args, **kwargs):
    pass


def mla_attention_backward(*args, **kwargs):
    raise NotImplementedError('mla_attention_backward')


def validate_mla_attention_backward(*args, **kwargs):
    pass

