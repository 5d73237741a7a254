"""The installed package's version, or the source checkout's when it is not installed."""
from __future__ import annotations

import re
from pathlib import Path

PACKAGE = "mxmla"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version() -> str:
    """The version pip recorded for mxmla; else the `version = "..."` of pyproject.toml beside this
    package (a checkout used through PYTHONPATH); else "unknown"."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(PACKAGE)
    except PackageNotFoundError:
        pass
    try:
        text = PYPROJECT.read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    project = text.split("[project]", 1)[-1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    return match.group(1) if match else "unknown"
