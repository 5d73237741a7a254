"""Collect benchmark rows into one markdown table (printed; BENCHMARKS.md takes it).

    python benchmarks/summarize.py FOLDER            # every bench_*.json in FOLDER
    python benchmarks/summarize.py results.json      # run_all.py's combined file

Each JSON file is a list of rows (dicts) or a dict with "rows" (and optionally "bench"). Columns (all
optional but `ms`): bench, op, shape, tokens, impl, ms, roofline_ms, of_roof (= roofline_ms / ms,
computed here), tbps, tflops, ratio, vs, note. Keys in HIDDEN are bookkeeping and not shown; any other
key is appended to the note column as key=value. docs/BENCHMARKING.md says what each column means.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("bench", "op", "shape", "tokens", "impl", "ms", "roofline_ms", "of_roof", "tbps", "tflops", "ratio",
           "vs", "note")
HIDDEN = ("device", "family", "bytes", "flops")


def fmt(v):
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "x".join(str(x) for x in v)
    return "" if v is None else str(v)


def load_rows(path: Path) -> list[dict]:
    """The rows of one JSON file, each with a `bench` key (from the file, or its name bench_<x>.json)."""
    data = json.loads(path.read_text())
    bench = path.stem[len("bench_"):] if path.stem.startswith("bench_") else None
    if isinstance(data, dict):
        bench = data.get("bench", bench)
        data = data.get("rows", [data])
    rows = []
    for row in data:
        row = dict(row)
        if bench and not row.get("bench"):
            row["bench"] = bench
        rows.append(row)
    return rows


def cells(row: dict) -> list[str]:
    out = []
    for key in COLUMNS:
        if key == "of_roof":
            roof, ms = row.get("roofline_ms"), row.get("ms")
            out.append(fmt(roof / ms) if isinstance(roof, (int, float)) and isinstance(ms, (int, float)) and ms > 0
                       else "")
        elif key == "note":
            extra = {k: v for k, v in row.items() if k not in COLUMNS and k not in HIDDEN and v is not None}
            note = fmt(row.get("note"))
            if extra:
                note = (note + " " if note else "") + " ".join(f"{k}={fmt(v)}" for k, v in extra.items())
            out.append(note.replace("|", "/"))
        else:
            out.append(fmt(row.get(key)).replace("|", "/"))
    return out


def table_lines(rows: list[dict]) -> list[str]:
    lines = [f"| {' | '.join(COLUMNS)} |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a folder of bench_*.json files, or one JSON file (e.g. results.json)")
    ap.add_argument("--commit", default="")
    args = ap.parse_args(argv)
    path = Path(args.path)
    files = [path] if path.is_file() else sorted(path.glob("bench_*.json"))
    rows, broken = [], []
    for f in files:
        try:
            rows += load_rows(f)
        except Exception as exc:  # noqa: BLE001 - a broken file must not hide the others
            broken.append(f"{f.name}: unreadable ({exc})")
    devices = sorted({str(r["device"]) for r in rows if r.get("device")})
    if args.commit or devices:
        print(f"commit {args.commit or '?'}; device {', '.join(devices) or '?'}")
    for line in broken:
        print(line)
    print("\n".join(table_lines(rows)))


if __name__ == "__main__":
    main()
