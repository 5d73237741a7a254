"""Errors the dispatcher raises. Both name what was asked and list every reason or valid choice."""
from __future__ import annotations


class BackendUnavailable(RuntimeError):
    """The backend(s) asked for (argument or MXMLA_BACKEND) cannot serve this call; never a fallback."""

    def __init__(self, op: str, requested, reasons: dict):
        self.op = op
        self.requested = requested
        self.reasons = reasons
        lines = [f"{op}: no requested backend can serve this call (asked for: {requested})"]
        for backend, why in reasons.items():
            for r in why:
                lines.append(f"  {backend}: {r}")
        super().__init__("\n".join(lines))


class DispatchConfigError(ValueError):
    """An unknown op or backend name, in an argument or in MXMLA_BACKEND."""
