"""STUB: torch backend for gemm (see docs/ARCHITECTURE.md)."""
