"""tools/junit_summary.py: per-file counts and seconds, files of the same name in different folders kept
apart, class-based tests counted under their file, failures listed with their first line."""
from __future__ import annotations

from tests.util import load_tool


def test_counts_per_file(tmp_path, capsys):
    xml = tmp_path / "tests.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.conformance.test_rope" name="a" time="1.5"/>'
                   '<testcase classname="tests.test_rope" name="b" time="0.5"><skipped message="no GPU"/></testcase>'
                   '<testcase classname="tests.test_rope.TestK" name="c" time="0.25">'
                   '<failure message="boom&#10;detail"/></testcase>'
                   '<testcase time="0.000"/>'  # what an interrupted pytest-xdist run leaves
                   '</testsuite></testsuites>')
    assert load_tool("junit_summary").main(str(xml)) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[1:] == [["conformance/test_rope.py", "1", "0", "0", "1.5"],
                        ["test_rope.py", "0", "1", "1", "0.8"],
                        ["total", "1", "1", "1", "2.2"],
                        "(1 entries without a test file, as an interrupted run writes, not counted)".split(),
                        ["FAILED", "tests.test_rope.TestK::c:", "boom"]]


def test_unreadable_file_says_so(tmp_path, capsys):
    assert load_tool("junit_summary").main(str(tmp_path / "missing.xml")) == 1
    assert "no readable" in capsys.readouterr().out
