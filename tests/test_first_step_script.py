"""benchmarks/first_step.py on CPU: each case's first process gets new empty Triton, Inductor and mxmla
cache folders and its second process the same (now filled) folders; a failed child is reported, not
raised; the table shows every case."""
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import first_step  # noqa: E402

CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MXMLA_CACHE_DIR")


def test_fresh_then_second_process_share_new_empty_caches(monkeypatch):
    seen = []

    def fake_run(cmd, env, capture_output, text, timeout):
        dirs = [env[v] for v in CACHE_VARS]
        seen.append((cmd, dirs, [os.path.exists(d) and os.listdir(d) for d in dirs]))
        for d in dirs:  # the child fills its caches
            os.makedirs(d, exist_ok=True)
            Path(d, "entry").write_text("x")
        out = "FIRST_STEP " + json.dumps({"step_s": 3.0 if len(seen) == 1 else 0.5, "build_s": 1.0})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(first_step.subprocess, "run", fake_run)
    row = first_step.run_case("unrecorded", breakdown=False)
    (cmd1, dirs1, before1), (cmd2, dirs2, before2) = seen
    assert dirs1 == dirs2 and len(set(dirs1)) == 3
    assert before1 == [False, False, False]  # fresh: the folders do not exist yet
    assert all(before2)  # second: what the first process left
    assert cmd1[-2:] == ["--child", "unrecorded"] and cmd2 == cmd1
    assert row["fresh_s"] == 3.0 and row["second_s"] == 0.5
    assert not any(os.path.exists(d) for d in dirs1)  # the temporary folders are gone
    table = first_step.table([row, {"label": "failed case"}])
    assert "block mxfp8 B1 S6144 H96" in table and "3.0" in table and "failed case" in table


def test_a_failed_child_is_reported(monkeypatch):
    monkeypatch.setattr(first_step.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="boom"))
    row = first_step.run_case("hf", breakdown=False)
    assert row["fresh_error"] == "boom" and "fresh_s" not in row and "second_s" not in row
