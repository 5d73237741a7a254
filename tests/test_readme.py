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


def missing_modules(source: str):
    """Top-level modules the snippet imports that this environment lacks (optional extras)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


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
    missing = missing_modules(source)
    if missing:
        pytest.skip(f"README snippet {index} needs {', '.join(missing)}, not installed here")
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
