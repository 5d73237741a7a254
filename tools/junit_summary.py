"""Per-file pass / fail / skip counts of a pytest JUnit XML file, and every failure's first line.

    python tools/junit_summary.py conformance.xml
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(path: str) -> int:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"junit_summary: no readable {path} ({type(exc).__name__}: {exc})")
        return 1
    counts = defaultdict(lambda: defaultdict(int))
    failures = []
    for case in root.iter("testcase"):
        module = case.get("classname", "?").split(".")
        name = next((m for m in module if m.startswith("test_")), module[-1])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                failures.append(f"{case.get('classname')}::{case.get('name')}: "
                                f"{(child.get('message') or '').splitlines()[0][:200] if child.get('message') else ''}")
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[name][outcome] += 1
    print(f"{'file':36} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for name in sorted(counts):
        c = counts[name]
        print(f"{name:36} {c['passed']:7d} {c['failed']:7d} {c['skipped']:8d}")
    total = {k: sum(c[k] for c in counts.values()) for k in ("passed", "failed", "skipped")}
    print(f"{'total':36} {total['passed']:7d} {total['failed']:7d} {total['skipped']:8d}")
    for line in failures[:30]:
        print("FAILED", line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
