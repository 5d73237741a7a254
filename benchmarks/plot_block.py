"""Plot the MLA block benchmark: training-step time and peak activation memory per path, per shape.

    python benchmarks/plot_block.py block.json --out block.png

Reads the JSON that benchmarks/bench_block.py writes:

    {"rows": [{"shape": "B1 S4096", "path": "mxfp8", "step_ms": 12.3, "fwd_ms": ..., "bwd_ms": ...,
               "peak_act_gib": 3.1, "first_step_fresh_s": ... | null, "first_step_second_s": ... | null}, ...],
     "meta": {...}}

and draws one PNG with two panels of grouped bars: step ms (forward + backward) and peak
activation GiB, one group per shape, one bar per path, in the order the rows first name them. A row
missing a panel's value leaves that bar out (a panel with no values says so). Needs matplotlib (the package's [plot] extra); without it
nothing is drawn and one line says so.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PANELS = (("step_ms", "step time (ms)"), ("peak_act_gib", "peak activation memory (GiB)"))
NO_MATPLOTLIB = "plot_block: no plot drawn: matplotlib is not installed (pip install matplotlib, or the [plot] extra)"


def load_rows(path: Path) -> Tuple[List[dict], dict]:
    """(rows, meta) of a bench_block JSON, or of `mxmla bench`'s results.json (its block rows only);
    ValueError naming the file and the first bad row otherwise."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: expected a JSON object with a 'rows' list (bench_block.py's output)")
    rows = [r for r in data["rows"] if not isinstance(r, dict) or r.get("bench", "block") == "block"]
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("shape"), str) or not isinstance(row.get("path"), str):
            raise ValueError(f"{path}: rows[{i}]: expected an object with string 'shape' and 'path', got {row!r}")
    meta = dict(data.get("meta") or {})
    for key in ("device", "commit", "date"):  # the runner keeps these beside the rows, or in each row
        if key not in meta and isinstance(data.get(key), str):
            meta[key] = data[key]
        if key not in meta and rows and isinstance(rows[0].get(key), str):
            meta[key] = rows[0][key]
    return rows, meta


def _value(row: dict, key: str) -> Optional[float]:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def table(rows: List[dict], key: str) -> Tuple[List[str], List[str], Dict[Tuple[str, str], float]]:
    """(shapes, paths, {(shape, path): value}) in first-seen order; the last row of a pair wins."""
    shapes, paths, values = [], [], {}
    for row in rows:
        shape, path = row["shape"], row["path"]
        if shape not in shapes:
            shapes.append(shape)
        if path not in paths:
            paths.append(path)
        v = _value(row, key)
        if v is not None:
            values[(shape, path)] = v
    return shapes, paths, values


def _title(meta: dict) -> str:
    parts = [str(meta[k]) for k in ("device", "commit", "date") if meta.get(k)]
    return "MLA block training step" + (f" ({', '.join(parts)})" if parts else "")


def plot(rows: List[dict], meta: dict, out: Path) -> Optional[Path]:
    """Draw the two panels into `out`; None (and nothing written) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.2), dpi=120)
    for ax, (key, label) in zip(axes, PANELS):
        shapes, paths, values = table(rows, key)
        width = 0.8 / max(1, len(paths))
        for j, path in enumerate(paths):
            xs = [i + (j - (len(paths) - 1) / 2) * width for i, s in enumerate(shapes) if (s, path) in values]
            ys = [values[(s, path)] for s in shapes if (s, path) in values]
            bars = ax.bar(xs, ys, width, label=path)
            ax.bar_label(bars, labels=[f"{v:.4g}" for v in ys], fontsize=7, padding=1)
        if not values:  # e.g. a CPU run has no CUDA memory figures
            ax.text(0.5, 0.5, f"no {key} in these rows", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(meta), fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="bench_block.py's JSON")
    ap.add_argument("--out", type=Path, help="PNG to write (default: the JSON's name with .png)")
    args = ap.parse_args(argv)
    rows, meta = load_rows(args.json)
    written = plot(rows, meta, args.out or args.json.with_suffix(".png"))
    if written is None:
        print(NO_MATPLOTLIB)
        return 0
    print(f"plot_block: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
