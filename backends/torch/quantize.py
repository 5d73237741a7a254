"""STUB: torch backend for quantize (see docs/ARCHITECTURE.md)."""
