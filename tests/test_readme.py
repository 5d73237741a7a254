"""The docs hold what is true: README.md's Python snippets run as written, every relative link in
README.md, BENCHMARKS.md and docs/*.md names a file that exists, and benchmarks/results/ keeps only the
raw files those docs link to (older runs live in git history)."""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

from tests import titan_compat

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
LINE_LIMITS = {"README.md": 200, "BENCHMARKS.md": 350}
MAX_RESULT_FILES = 120

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# [text](target) and ![alt](target); the target ends at the first space or closing parenthesis
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def python_blocks():
    return _PYTHON_BLOCK.findall(README.read_text())


OWN_PACKAGES = {"dispatch", "spec", "backends"}


def unavailable_imports(source: str):
    """The snippet's imports of optional packages that do not import here, each with why (absent, or
    present but failing to import: TorchTitan 0.3.0 on torch < 2.12; or TorchTitan importing only
    through tests/titan_compat.py's stand-ins, which the TorchTitan tests install in this process on such
    a torch and a user's does not have). The project's own packages are never excused: their import
    errors fail the test."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    reasons = []
    for name in sorted(m for m in modules if m.split(".")[0] not in OWN_PACKAGES):
        if importlib.util.find_spec(name.split(".")[0]) is None:
            reasons.append(f"{name} (not installed)")
            continue
        if name.split(".")[0] == "torchtitan" and titan_compat.stood_in():  # a user's torch has no stand-ins
            reasons.append(f"{name} (imports here only through the TorchTitan tests' stand-ins for "
                           f"{', '.join(titan_compat.stood_in())}: torch {torch.__version__} lacks them)")
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            reasons.append(f"{name} ({exc})")
    return reasons


def relative_links(doc: Path):
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        yield target, (doc.parent / unquote(target.split("#")[0])).resolve()


def test_readme_has_python_snippets():
    assert len(python_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_snippet_runs(index, capsys):
    source = python_blocks()[index]
    unavailable = unavailable_imports(source)
    if unavailable:
        pytest.skip(f"README snippet {index} needs what does not import here: {'; '.join(unavailable)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core CI machine: small ops wait for a busy second thread
    torch.manual_seed(0)
    try:
        exec(compile(source, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = [target for target, path in relative_links(doc) if not path.exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.parametrize("name", sorted(LINE_LIMITS))
def test_report_length(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= LINE_LIMITS[name], f"{name}: {lines} lines, the limit is {LINE_LIMITS[name]}"


def test_results_hold_only_linked_files():
    files = sorted(p.resolve() for p in RESULTS.rglob("*") if p.is_file())
    linked = {path for doc in DOCS for _, path in relative_links(doc)}
    unlinked = [str(p.relative_to(ROOT)) for p in files if p not in linked]
    assert not unlinked, (f"{len(unlinked)} files under benchmarks/results/ that no doc links to (git rm them; "
                          f"history keeps them): {unlinked[:10]}")
    assert len(files) <= MAX_RESULT_FILES, f"{len(files)} files under benchmarks/results/"


def test_a_snippet_whose_optional_package_fails_to_import_is_excused(monkeypatch):
    """A package that is installed but fails at import (TorchTitan 0.3.0 on torch 2.11) skips the snippet;
    the project's own packages are never excused."""
    real = importlib.import_module

    def failing(name, *args, **kwargs):
        if name.startswith("torchtitan") or name.startswith("dispatch"):
            raise ImportError("cannot import name 'DataParallelMeshDims'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", failing)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(titan_compat, "stood_in", lambda: [])
    source = "from torchtitan.models.deepseek_v3 import model_registry\nfrom dispatch.integrations.torchtitan import X\n"
    assert unavailable_imports(source) == ["torchtitan.models.deepseek_v3 (cannot import name 'DataParallelMeshDims')"]


def test_a_torchtitan_snippet_is_excused_where_it_imports_only_through_the_tests_stand_ins(monkeypatch):
    """On torch 2.11 the TorchTitan tests stand in for names TorchTitan imports (tests/titan_compat.py);
    a README snippet is a user's code, which has no stand-ins, so it is not run with them."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(titan_compat, "stood_in", lambda: ["torch.distributed.fsdp.DataParallelMeshDims"])
    (reason,) = unavailable_imports("from torchtitan.models.deepseek_v3 import model_registry\n")
    assert reason.startswith("torchtitan.models.deepseek_v3 (imports here only through the TorchTitan tests' "
                             "stand-ins for torch.distributed.fsdp.DataParallelMeshDims")
