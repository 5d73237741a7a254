"""tools/parallel_check.py --smoke on 1 (bf16 path) and 2 (both paths) gloo ranks: every check passes, the table prints, the JSON
holds every rank's rows, and TP's forward has exactly one collective (o_proj's all-reduce; W=1: none).
The benchmark's default device is set to another one than the group's, as on a GPU machine."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tests.parallel_spawn import run_ranks  # noqa: E402
from tests.util import load_tool  # noqa: E402


def _run(rank, world, out, paths):
    argv = ["--smoke", "--steps", "1", "--warmup", "0", "--paths", paths, "--out", out]
    tool = load_tool("parallel_check")
    # a GPU machine's situation on any machine: the benchmark's own default device is not the one the
    # gloo group serves (the CPU), so every tensor must come from the device parallel_check names ("meta"
    # stands in for the GPU: a tensor made there instead fails the first op that meets a CPU tensor)
    tool.bench_block.DEVICE = "meta"
    return {"rc": tool.main(argv)}


@pytest.mark.parametrize("world, paths", [(1, "bf16"), (2, "mxfp8,bf16")])
def test_smoke(tmp_path, capfd, world, paths):
    out = str(tmp_path / "parallel.json")
    results = run_ranks(_run, world, out, paths, timeout=150)
    assert [r["rc"] for r in results] == [0] * world
    printed = capfd.readouterr().out
    assert f"parallel_check: {world} rank(s), gloo" in printed and "FAIL" not in printed
    with open(out) as f:
        record = json.load(f)
    assert record["world"] == world and len(record["ranks"]) == world
    for rows in record["ranks"]:
        assert [(r["path"], r["mode"]) for r in rows] == [(p, m) for p in paths.split(",")
                                                          for m in ("single", "TP", "CP")]
        for row in rows:
            assert row["step_ms"] > 0
            if row["mode"] != "single":
                assert row["ok"] and row["max_rel_err"] <= row["bound"], row
            if row["mode"] == "TP":
                want = {} if world == 1 else {"c10d_functional.all_reduce": 1}
                assert row["fwd_collectives"] == want, row["fwd_collectives"]


def _device_where_cuda_is(rank, world):
    torch.cuda.is_available = lambda: True  # as on a GPU machine: the gloo group still means the CPU
    device, made = load_tool("parallel_check").init_distributed()
    return {"device": str(device), "made": made}


def test_a_gloo_group_runs_on_the_cpu_also_where_cuda_is():
    """gloo's send / recv move host memory only, so the check joins a gloo group on the CPU."""
    assert run_ranks(_device_where_cuda_is, 2) == [{"device": "cpu", "made": False}] * 2
