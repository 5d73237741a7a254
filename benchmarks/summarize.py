"""Collect every bench_*.json in a folder into one markdown table (printed; BENCHMARKS.md takes it).

Each JSON file is a list of rows (dicts). Recognised keys, all optional but `ms`: op, shape, impl,
ms, tbps, tflops, ratio, vs, note. Unknown keys are shown in the note column.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

KNOWN = ("op", "shape", "impl", "ms", "tbps", "tflops", "ratio", "vs", "note")


def fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "x".join(str(x) for x in v)
    return "" if v is None else str(v)


def rows_of(path: Path):
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("rows", [data])
    for row in data:
        extra = {k: v for k, v in row.items() if k not in KNOWN}
        note = row.get("note", "")
        if extra:
            note = (note + " " if note else "") + " ".join(f"{k}={fmt(v)}" for k, v in extra.items())
        yield [fmt(row.get(k)) for k in KNOWN[:-1]] + [note]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    files = sorted(Path(args.folder).glob("bench_*.json"))
    print(f"| {' | '.join(KNOWN)} |")
    print("|" + "---|" * len(KNOWN))
    for f in files:
        try:
            for r in rows_of(f):
                print("| " + " | ".join(r) + " |")
        except Exception as exc:  # noqa: BLE001 - a broken file must not hide the others
            print(f"| {f.name}: unreadable ({exc}) |")


if __name__ == "__main__":
    main()
