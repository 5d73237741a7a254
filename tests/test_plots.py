"""Plots through matplotlib: the block benchmark's two panels (benchmarks/plot_block.py) and the example's
loss curves; without matplotlib nothing is drawn and one message says so."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import plot_block  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_block_json(path: Path) -> Path:
    """bench_block.py's schema: two shapes x three paths, one row without a memory figure, one with
    null first-step times."""
    rows = []
    for shape, scale in (("B1 S4096", 1.0), ("B2 S4096", 2.1)):
        for name, ms, gib in (("torch bf16", 10.1, 3.6), ("bf16", 11.0, 3.2), ("mxfp8", 9.4, 2.5)):
            rows.append(dict(shape=shape, path=name, step_ms=ms * scale, fwd_ms=0.4 * ms * scale,
                             bwd_ms=0.6 * ms * scale, peak_act_gib=gib * scale, first_step_fresh_s=31.5,
                             first_step_second_s=None))
    rows[-1]["peak_act_gib"] = None
    path.write_text(json.dumps({"rows": rows, "meta": {"device": "NVIDIA H200", "commit": "0123abc"}}))
    return path


def test_table_keeps_first_seen_order_and_drops_missing_values(tmp_path):
    rows, meta = plot_block.load_rows(fake_block_json(tmp_path / "block.json"))
    shapes, paths, values = plot_block.table(rows, "peak_act_gib")
    assert shapes == ["B1 S4096", "B2 S4096"] and paths == ["torch bf16", "bf16", "mxfp8"]
    assert ("B2 S4096", "mxfp8") not in values and values[("B1 S4096", "mxfp8")] == 2.5
    assert meta["commit"] == "0123abc"


def test_rows_of_the_runners_results_json_are_the_block_rows(tmp_path):
    results = tmp_path / "results.json"
    block = json.loads(fake_block_json(tmp_path / "block.json").read_text())["rows"]
    other = dict(bench="rope", op="rope", shape="[4096,128,192]", impl="triton", ms=0.1)
    results.write_text(json.dumps({"commit": "0123abc", "device": "NVIDIA H200", "rows": [other] + [
        dict(r, bench="block") for r in block]}))
    rows, meta = plot_block.load_rows(results)
    assert len(rows) == len(block) and {r["bench"] for r in rows} == {"block"}
    assert meta == {"device": "NVIDIA H200", "commit": "0123abc"}


def test_plot_block_writes_a_two_panel_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = fake_block_json(tmp_path / "block.json")
    assert plot_block.main([str(src), "--out", str(tmp_path / "plots" / "block.png")]) == 0
    png = (tmp_path / "plots" / "block.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (11 * 120, int(4.2 * 120))  # figsize x dpi: both panels side by side
    assert capsys.readouterr().out.strip() == f"plot_block: {tmp_path / 'plots' / 'block.png'}"


def test_plot_block_without_matplotlib_says_so_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    src = fake_block_json(tmp_path / "block.json")
    assert plot_block.main([str(src)]) == 0
    assert capsys.readouterr().out.splitlines() == [plot_block.NO_MATPLOTLIB]
    assert not src.with_suffix(".png").exists()


def test_plot_block_names_a_bad_row(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"shape": "B1 S4096", "path": "mxfp8"}, {"shape": 4096}]}))
    with pytest.raises(ValueError, match=r"rows\[1\]: expected an object with string 'shape' and 'path'"):
        plot_block.load_rows(bad)
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="'rows' list"):
        plot_block.load_rows(bad)


def test_example_loss_plot_without_matplotlib_draws_nothing(tmp_path, monkeypatch):
    import mla_block

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    what = mla_block.plot_losses({"mxfp8": [1.0, 0.5, 0.25]}, str(tmp_path / "loss.png"), "t")
    assert what == mla_block.PLOT_SKIPPED and "matplotlib is not installed" in what
    assert not (tmp_path / "loss.png").exists()


def test_example_loss_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    import mla_block

    assert mla_block.plot_losses({"mxfp8": [1.0, 0.5, 0.25], "torch": [1.0, 0.6, 0.3]},
                                 str(tmp_path / "loss.png"), "t") == "matplotlib"
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC
