"""STUB: torch backend for swizzle (see docs/ARCHITECTURE.md)."""
