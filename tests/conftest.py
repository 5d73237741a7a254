"""Session-wide test setup."""
import os

# Without a GPU, the Triton backend runs in the interpreter; this must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
