"""STUB: torch backend for rope (see docs/ARCHITECTURE.md)."""
