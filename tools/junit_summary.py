"""Per-file pass / fail / skip counts and seconds of a pytest JUnit XML file, and every failure's
first line (the first 30).

    python tools/junit_summary.py tests.xml
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_of(classname: str) -> str:
    """The test file of a JUnit classname: "tests.conformance.test_rope.TestX" -> "conformance/test_rope.py"
    (tests/test_rope.py and tests/conformance/test_rope.py stay apart)."""
    parts = classname.split(".")
    end = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
    parts = parts[:end + 1]
    if parts[0] == "tests" and len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts) + ".py"


def main(path: str) -> int:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"junit_summary: no readable {path} ({type(exc).__name__}: {exc})")
        return 1
    counts = defaultdict(lambda: defaultdict(float))
    failures = []
    unnamed = 0
    for case in root.iter("testcase"):
        if not case.get("classname"):  # an interrupted run's placeholder, no test of its own
            unnamed += 1
            continue
        name = file_of(case.get("classname"))
        counts[name]["seconds"] += float(case.get("time") or 0.0)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                failures.append(f"{case.get('classname')}::{case.get('name')}: "
                                f"{(child.get('message') or '').splitlines()[0][:200] if child.get('message') else ''}")
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[name][outcome] += 1
    width = max([len("total")] + [len(name) for name in counts]) + 1
    print(f"{'file':{width}} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}")
    for name in sorted(counts):
        c = counts[name]
        print(f"{name:{width}} {c['passed']:7.0f} {c['failed']:7.0f} {c['skipped']:8.0f} {c['seconds']:8.1f}")
    total = {k: sum(c[k] for c in counts.values()) for k in ("passed", "failed", "skipped", "seconds")}
    print(f"{'total':{width}} {total['passed']:7.0f} {total['failed']:7.0f} {total['skipped']:8.0f} "
          f"{total['seconds']:8.1f}")
    if unnamed:
        print(f"({unnamed} entries without a test file, as an interrupted run writes, not counted)")
    for line in failures[:30]:
        print("FAILED", line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
