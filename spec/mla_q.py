"""STUB: to be written (see docs/ARCHITECTURE.md)."""

def mla_q_uproj_rope_quant(*args, **kwargs):
    raise NotImplementedError('mla_q_uproj_rope_quant')


def validate_mla_q_uproj_rope_quant(*args, **kwargs):
    pass


def mla_q_uproj_rope_quant_backward(*args, **kwargs):
    raise NotImplementedError('mla_q_uproj_rope_quant_backward')


def validate_mla_q_uproj_rope_quant_backward(*args, **kwargs):
    pass

