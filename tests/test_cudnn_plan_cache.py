"""The cuDNN backend's on-disk plan cache (backends/cudnn/plan_cache.py) on CPU, with the frontend mocked:
what is written, when a file is loaded instead of building, and that every failure (a damaged file,
another machine's plan, a frontend that cannot serialize, an unwritable directory) falls back to
building. tests/conformance/test_attention_cudnn.py loads real plans on CUDA and compares bytes."""
from __future__ import annotations

import json
import os
import stat

import pytest

torch = pytest.importorskip("torch")

from backends.cudnn import attention as att  # noqa: E402
from backends.cudnn import plan_cache  # noqa: E402
from tests.test_cudnn_backend import FakeGraph, bf16_inputs, fake  # noqa: E402,F401  (fake: a fixture)


class SerializableGraph(FakeGraph):
    """A fake graph whose plan serializes to JSON of its ops' names and loads back."""

    def serialize(self, as_bytes=False):
        blob = json.dumps({"ops": [op[0] for op in self.ops]}).encode()
        return blob if as_bytes else list(blob)

    def deserialize(self, handle, data):
        self.loaded_from = json.loads(bytes(data).decode())
        self.handle = handle


@pytest.fixture
def disk(fake, tmp_path, monkeypatch):
    """The fake frontend with serializable graphs, the cache in tmp_path, CPU graphs admitted (index -1)
    and a fixed machine fingerprint."""
    fake.pygraph = SerializableGraph
    monkeypatch.setenv("MXMLA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MXMLA_CUDNN_PLAN_CACHE", raising=False)
    monkeypatch.setattr(plan_cache, "usable", lambda index: plan_cache.enabled())
    monkeypatch.setattr(plan_cache, "fingerprint", lambda index: "fake machine")
    plan_cache._reported.clear()
    return tmp_path / "cudnn"


def _plans(folder):
    return sorted(folder.glob("*.plan")) if folder.exists() else []


def _call(causal=True):
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    return att.mla_attention(q, k, v, causal=causal)


def test_built_graph_is_written_then_loaded(disk):
    stored, loaded = plan_cache.stored_count, plan_cache.loaded_count
    _call()
    (built,) = FakeGraph.instances
    assert built.built_with is not None and plan_cache.stored_count == stored + 1
    (path,) = _plans(disk)
    assert stat.S_IMODE(os.stat(disk).st_mode) == 0o700
    assert not [p for p in disk.iterdir() if p.name.startswith(".plan-")]  # no temporary left behind
    att.clear_cache()  # a new process, as far as the graphs are concerned
    _call()
    assert plan_cache.loaded_count == loaded + 1 and len(FakeGraph.instances) == 2
    fresh = FakeGraph.instances[1]
    assert fresh.built_with is None and fresh.loaded_from == {"ops": ["sdpa"]}
    (pack, ws, _), = fresh.executions
    (built_pack, _, _), = built.executions
    assert list(pack) == list(built_pack)  # the loaded graph binds the same uids in the same order
    assert _plans(disk) == [path]


def test_cache_off_writes_and_reads_nothing(disk, monkeypatch):
    monkeypatch.setenv("MXMLA_CUDNN_PLAN_CACHE", "0")
    _call()
    assert _plans(disk) == []
    monkeypatch.setenv("MXMLA_CUDNN_PLAN_CACHE", "1")
    _call(causal=False)  # another key: built and written
    assert len(_plans(disk)) == 1
    monkeypatch.setenv("MXMLA_CUDNN_PLAN_CACHE", "0")
    att.clear_cache()
    loaded = plan_cache.loaded_count
    _call(causal=False)
    assert plan_cache.loaded_count == loaded  # off: the file is not read


def test_bad_switch_value_names_the_variable(disk, monkeypatch):
    monkeypatch.setenv("MXMLA_CUDNN_PLAN_CACHE", "yes")
    with pytest.raises(ValueError, match="MXMLA_CUDNN_PLAN_CACHE"):
        _call()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "other machine", "refused"])
def test_unusable_file_is_built_over(disk, monkeypatch, caplog, damage):
    _call()
    (path,) = _plans(disk)
    raw = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "truncated":
        path.write_bytes(raw[: len(plan_cache.MAGIC) + 2])
    elif damage in ("other key", "other machine"):
        start = len(plan_cache.MAGIC) + plan_cache._LEN.size
        (n,) = plan_cache._LEN.unpack_from(raw, len(plan_cache.MAGIC))
        header = json.loads(raw[start:start + n])
        header["key" if damage == "other key" else "fingerprint"] = "something else"
        head = json.dumps(header).encode()
        path.write_bytes(plan_cache.MAGIC + plan_cache._LEN.pack(len(head)) + head + raw[start + n:])
    else:
        def refuse(self, handle, data):
            raise RuntimeError("CUDNN_STATUS_BAD_PARAM: plan from another library version")

        monkeypatch.setattr(SerializableGraph, "deserialize", refuse)
    att.clear_cache()
    loaded, stored = plan_cache.loaded_count, plan_cache.stored_count
    with caplog.at_level("INFO", logger="mxmla.cudnn"):
        _call()
    assert plan_cache.loaded_count == loaded and plan_cache.stored_count == stored + 1
    assert FakeGraph.instances[-1].built_with is not None  # built, then its plan written over the file
    assert any("loading" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == raw


def test_frontend_that_cannot_serialize_still_serves(disk, monkeypatch):
    def cannot(self, as_bytes=False):
        raise RuntimeError("serialize(): this engine is not runtime compiled")

    monkeypatch.setattr(SerializableGraph, "serialize", cannot)
    o, lse = _call()
    assert o.shape == (1, 64, 2, 128) and _plans(disk) == []
    assert not [p for p in disk.iterdir()] if disk.exists() else True  # no temporary left behind


def test_unwritable_directory_still_serves(disk, tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MXMLA_CACHE_DIR", str(blocker))
    stored = plan_cache.stored_count
    o, _ = _call()
    assert o.shape == (1, 64, 2, 128) and plan_cache.stored_count == stored


def test_cpu_graphs_never_touch_the_disk(fake, tmp_path, monkeypatch):
    """Without the test's admission of CPU graphs: a graph for a CPU tensor (device index -1) is
    neither looked up nor written."""
    fake.pygraph = SerializableGraph
    monkeypatch.setenv("MXMLA_CACHE_DIR", str(tmp_path))
    _call()
    assert not (tmp_path / "cudnn").exists()
    assert plan_cache.usable(-1) is False and plan_cache.usable(0) is True


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("MXMLA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache.directory() == os.path.join(str(tmp_path), "mxmla", "cudnn")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert plan_cache.directory() == os.path.join(os.path.expanduser("~"), ".cache", "mxmla", "cudnn")
