"""STUB: torch backend for attention (see docs/ARCHITECTURE.md)."""
