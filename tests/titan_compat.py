"""TorchTitan 0.3.0 on torch 2.11, for the TorchTitan tests and benchmarks/titan_block.py only.

TorchTitan 0.3.0 pins no torch, but some of its modules import names that torch 2.12 added, so on torch
2.11 (the GPU machines' build) `import torchtitan.models.deepseek_v3` fails before any of its code runs.
`install()` puts a stand-in for each such name that the tests' and the benchmark's paths import, and
only where this torch lacks the name; it must run before torchtitan is imported. Each stand-in raises
when anything uses it, so no behaviour is borrowed: where the paths here would need the real thing, they
fail naming it.

Not part of the user-facing integration (`dispatch.integrations.torchtitan`): a TorchTitan job on torch
2.11 fails in TorchTitan's own imports before mxmla is loaded, and mxmla does not patch torch's
namespace for its users.
"""
from __future__ import annotations

import importlib
import sys
from typing import List, Tuple


def _needs_newer_torch(qualname: str, used_by: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is a stand-in (tests/titan_compat.py): torch "
                                  f"{_torch_version()} lacks it and {used_by} needs torch >= 2.12")
    return refuse


def _torch_version() -> str:
    import torch

    return torch.__version__


class _DataParallelMeshDims:
    """Stand-in for torch 2.12's `torch.distributed.fsdp.DataParallelMeshDims`; building one raises."""

    __init__ = _needs_newer_torch("torch.distributed.fsdp.DataParallelMeshDims",
                                  "TorchTitan's full_dtensor backend (multi-axis meshes)")


_DataParallelMeshDims.__name__ = _DataParallelMeshDims.__qualname__ = "DataParallelMeshDims"

# (module, name, stand-in, why it is safe on the paths the tests and the benchmark take)
STAND_INS: Tuple[Tuple[str, str, object, str], ...] = (
    ("torch.distributed.fsdp", "DataParallelMeshDims", _DataParallelMeshDims,
     "torchtitan.distributed.fsdp / full_dtensor and models.deepseek_v3.mtp import it at module level, "
     "where it is an annotation or a None default; only TorchTitan's full_dtensor backend (multi-axis "
     "meshes) builds one, and no path here takes it"),
)

_installed: List[str] = []


def missing() -> List[Tuple[str, str]]:
    """(module, name) of each STAND_INS entry this torch lacks."""
    return [(module, name) for module, name, _, _ in STAND_INS
            if not hasattr(importlib.import_module(module), name)]


def stood_in() -> List[str]:
    """The qualified names stood in so far in this process (none until install() found one missing)."""
    return list(_installed)


def install() -> List[str]:
    """Install a stand-in for each name this torch lacks (nothing on torch >= 2.12), printing one line to
    stderr for each the first time. Returns the qualified names stood in so far in this process."""
    lacking = set(missing())
    for module, name, stand_in, why in STAND_INS:
        if (module, name) not in lacking:
            continue
        setattr(importlib.import_module(module), name, stand_in)
        _installed.append(f"{module}.{name}")
        print(f"titan_compat: torch {_torch_version()} lacks {module}.{name}, which torchtitan 0.3.0 imports; "
              f"stood in by a class that raises when built. Safe here: {why}", file=sys.stderr)
    return stood_in()
