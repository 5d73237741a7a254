"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def rope(*args, **kwargs):
    raise NotImplementedError('rope')


def validate_rope(*args, **kwargs):
    pass


def rope_backward(*args, **kwargs):
    raise NotImplementedError('rope_backward')


def validate_rope_backward(*args, **kwargs):
    pass

