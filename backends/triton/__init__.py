"""Triton backend (CUDA; on CPU only under TRITON_INTERPRET=1, for testing).

Every op module in this package registers its ops on import. The Gluon kernel modules (`*_gluon.py`)
register nothing and are imported only by the op module that launches them, when it does: a Triton
without `triton.experimental.gluon` (or without its Hopper API) keeps every other kernel online and
reports the Gluon variants' reason instead.

Under the interpreter every registered implementation runs holding one process-wide lock
(`_common.serialized`): Triton's interpreter keeps the launch grid and its patched `triton.language`
in module globals, so two threads interpreting at once corrupt each other's results. Triton decides
interpreted or compiled when a kernel is decorated, i.e. at import, so this is decided then too (the
compiled path gets no wrapper and no cost).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

from .. import registry
from ..registry import declare_backend

GLUON_SUFFIX = "_gluon"

try:
    import triton
except ImportError as exc:  # the backend shows as unavailable with the reason
    declare_backend("triton", False, reasons=[f"triton is not installed ({exc})"])
else:
    declare_backend("triton", True, version=triton.__version__)
    from ._common import interpret_mode, serialized, wait_background_compiles  # noqa: F401 (public)

    for _info in pkgutil.iter_modules(__path__):
        if not _info.name.startswith("_") and not _info.name.endswith(GLUON_SUFFIX):
            importlib.import_module(f"{__name__}.{_info.name}")
    from ._common import settle_cache_keys

    for _name in sorted(m for m in sys.modules if m.startswith(__name__ + ".")):
        settle_cache_keys(vars(sys.modules[_name]))
    if interpret_mode():
        registry.wrap_backend("triton", serialized)
