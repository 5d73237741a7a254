"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def rmsnorm_mxfp8(*args, **kwargs):
    raise NotImplementedError('rmsnorm_mxfp8')


def validate_rmsnorm_mxfp8(*args, **kwargs):
    pass

