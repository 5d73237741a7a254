"""ml_dtypes, loaded at its first attribute use.

Loading ml_dtypes' extension registers every cast among its types with NumPy: most of a second on a
2-core CPU, paid by every process that imports spec -- and spec is imported by backends and dispatch
for its types and validators, which never touch ml_dtypes. Only the reference computations and the
NumPy conversions do, and they load it here when they first run.
"""
from __future__ import annotations


class _LazyMlDtypes:
    def __getattr__(self, name: str):
        import ml_dtypes  # the import system's lock makes a first use from two threads safe

        return getattr(ml_dtypes, name)

    def __repr__(self) -> str:
        return "<ml_dtypes, loaded at first use>"


ml_dtypes = _LazyMlDtypes()
