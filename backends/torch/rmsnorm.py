"""STUB: torch backend for rmsnorm (see docs/ARCHITECTURE.md)."""
