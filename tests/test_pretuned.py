"""backends/triton/pretuned.py: recorded tile choices (matching the current device's name) fill an
autotuner's cache, only for configs it has, and not when switched off (tests/test_tile_choice.py: they
refine the heuristic tiles without autotuning)."""
import json

import pytest

triton = pytest.importorskip("triton")

from backends.triton import _common, pretuned  # noqa: E402
from backends.triton.tile_choice import first_config  # noqa: E402


@triton.jit
def _two_config_kernel(x_ptr, n, BLOCK: triton.language.constexpr):
    pass


def _tuner():
    configs = [triton.Config({"BLOCK": 64}, num_warps=4), triton.Config({"BLOCK": 128}, num_warps=8)]
    return _common.autotune_cached(configs=configs, key=["n"], heuristic=first_config)(_two_config_kernel)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(pretuned, "DIR", str(tmp_path))
    monkeypatch.setattr(pretuned, "_tables", {})
    monkeypatch.setattr(pretuned, "_current_device_name", lambda: "Fake GPU 9")
    monkeypatch.setattr(pretuned.settings, "interpret_mode", lambda: False)
    monkeypatch.delenv("MXMLA_TRITON_PRETUNED", raising=False)
    return tmp_path


def _write(folder, kernels):
    (folder / "fake_gpu_9.json").write_text(json.dumps({"device": "Fake GPU 9", "kernels": kernels}))


def test_register_names_kernel_and_numbers_repeats():
    a, b = _tuner(), _tuner()
    names = {t: n for n, t in pretuned.tuners().items()}
    assert names[a].endswith("test_pretuned._two_config_kernel")
    assert names[b].startswith(names[a] + "#")


def test_prefill_takes_recorded_choice(fake_gpu):
    tuner = _tuner()
    name = next(n for n, t in pretuned.tuners().items() if t is tuner)
    second = pretuned.config_kwargs(tuner.configs[1])
    _write(fake_gpu, {name: [[[4096, "torch.float32"], second], [[8, "torch.float32"], {"BLOCK": 32}]]})
    assert pretuned.prefill(name, tuner) == 1  # the BLOCK 32 entry names no config of this tuner
    assert tuner.cache == {(4096, "torch.float32"): tuner.configs[1]}
    assert pretuned.record()[name] == [[[4096, "torch.float32"], second]]


def test_switched_off_or_other_device(fake_gpu, monkeypatch):
    tuner = _tuner()
    name = next(n for n, t in pretuned.tuners().items() if t is tuner)
    _write(fake_gpu, {name: [[[4096, "torch.float32"], pretuned.config_kwargs(tuner.configs[0])]]})
    monkeypatch.setenv("MXMLA_TRITON_PRETUNED", "0")
    assert pretuned.prefill(name, tuner) == 0
    monkeypatch.delenv("MXMLA_TRITON_PRETUNED")
    monkeypatch.setattr(pretuned, "_current_device_name", lambda: "Other GPU")
    assert pretuned.prefill(name, tuner) == 0 and not tuner.cache


def test_bad_switch_value_raises(fake_gpu, monkeypatch):
    tuner = _tuner()
    monkeypatch.setenv("MXMLA_TRITON_PRETUNED", "yes")
    with pytest.raises(ValueError, match="MXMLA_TRITON_PRETUNED"):
        pretuned.prefill("x", tuner)


def test_shipped_tables_parse():
    """Every shipped table is JSON of the documented form (kernel -> [[key list, config dict]])."""
    import os

    for fname in os.listdir(pretuned.DIR) if os.path.isdir(pretuned.DIR) else ():
        with open(os.path.join(pretuned.DIR, fname)) as f:
            data = json.load(f)
        if fname.endswith(".compile.json"):  # compile_ahead's lists: workload -> [{call, compile}]
            assert data["arch"] + ".compile.json" == fname
            for entries in data["workloads"].values():
                assert all(set(e) == {"call", "compile"} and set(e["compile"]) == {"fn", "args", "options"}
                           for e in entries)
            continue
        assert set(data) >= {"device", "kernels"}
        assert pretuned.device_slug(data["device"]) + ".json" == fname
        for rows in data["kernels"].values():
            assert all(isinstance(k, list) and isinstance(c, dict) for k, c in rows)
