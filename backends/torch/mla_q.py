"""STUB: torch backend for mla_q (see docs/ARCHITECTURE.md)."""
