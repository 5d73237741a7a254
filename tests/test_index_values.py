"""Index inputs: what shapes decide is checked for every call on every backend (a RoPE table too short
for the tokens), index values (positions, cu_seqlens) on every CPU call, and on CUDA only under
MXMLA_CHECK_VALUES=1 (reading them costs a device synchronisation). Each error names the argument."""
from __future__ import annotations

import pytest
import torch

import dispatch
from backends.convert import to_numpy
from spec.checks import shape_checks_only
from tests.util import skip_without_triton_interpreter
import spec

BACKENDS = ["spec", "torch", "triton"]


def _rope_inputs(tokens=40, rows=32, heads=2, dim=64, rope_dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=g) * 4
    cos, sin = torch.randn(rows, rope_dim, generator=g), torch.randn(rows, rope_dim, generator=g)
    return x, cos, sin


def _as(backend, *ts):
    return [to_numpy(t) if backend == "spec" and isinstance(t, torch.Tensor) else t for t in ts]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("MXMLA_CHECK_VALUES", raising=False)
    monkeypatch.delenv("MXMLA_BACKEND", raising=False)
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["rope", "rope_backward"])
@pytest.mark.parametrize("layout", ["thd", "sbhd", "bshd"])
def test_table_shorter_than_the_sequence_raises_naming_cos(backend, op, layout):
    x, cos, sin = _rope_inputs(tokens=40, rows=32)
    if layout != "thd":
        x = x.reshape(40, 1, 2, 64) if layout == "sbhd" else x.reshape(1, 40, 2, 64)
    x, cos, sin = _as(backend, x, cos, sin)
    with pytest.raises(ValueError, match="^cos: tables have 32 rows but a token needs position 39"):
        dispatch.run(op, x, cos, sin, layout=layout, backend=backend)


def test_table_length_is_decided_from_shapes_alone():
    x, cos, sin = _rope_inputs(tokens=40, rows=32)
    with shape_checks_only(), pytest.raises(ValueError, match="^cos: "):
        spec.validate_rope(x.numpy(), cos.numpy(), sin.numpy())
    # context parallelism: rank 0 of 2 holds global chunks 0 and 3 of 10 tokens: position 39 is needed
    x, cos, sin = _rope_inputs(tokens=20, rows=39)
    with shape_checks_only(), pytest.raises(ValueError, match="needs position 39"):
        spec.validate_rope(x.numpy(), cos.numpy(), sin.numpy(), cp_size=2, cp_rank=0)
    x, cos, sin = _rope_inputs(tokens=20, rows=40)
    with shape_checks_only():
        spec.validate_rope(x.numpy(), cos.numpy(), sin.numpy(), cp_size=2, cp_rank=0)
    x, cos, sin = _rope_inputs(tokens=21, rows=64)
    with shape_checks_only(), pytest.raises(ValueError, match="^x: sequence 0 has local length 21"):
        spec.validate_rope(x.numpy(), cos.numpy(), sin.numpy(), cp_size=2, cp_rank=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_past_the_table_raise_on_cpu(backend):
    if backend == "triton":
        skip_without_triton_interpreter()
    x, cos, sin = _rope_inputs(tokens=8, rows=32)
    positions = torch.tensor([0, 3, 31, 7, 32, 1, 2, 5], dtype=torch.int32)
    x, cos, sin, positions = _as(backend, x, cos, sin, positions)
    for _ in range(2):  # the second call finds the cached selection and still checks the values
        with pytest.raises(ValueError, match=r"^positions: value 32 out of range \[0, 32\)"):
            dispatch.run("rope", x, cos, sin, positions=positions, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu, needle", [([0, 40, 32], "non-decreasing"), ([4, 20, 40], "start at 0"),
                                        ([0, 20, 30], "end at T=40")])
def test_bad_cu_seqlens_raise_on_cpu(backend, cu, needle):
    if backend == "triton":
        skip_without_triton_interpreter()
    x, cos, sin = _rope_inputs(tokens=40, rows=64)
    good = torch.tensor([0, 20, 40], dtype=torch.int32)
    bad = torch.tensor(cu, dtype=torch.int32)
    x, cos, sin, good, bad = _as(backend, x, cos, sin, good, bad)
    dispatch.run("rope", x, cos, sin, cu_seqlens=good, backend=backend)  # same signature, cached
    with pytest.raises(ValueError, match=f"^cu_seqlens: expected .*{needle}"):
        dispatch.run("rope", x, cos, sin, cu_seqlens=bad, backend=backend)


def _attention_thd(cu_q, cu_kv, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(8, 2, 192, generator=g).bfloat16()
    k = torch.randn(8, 2, 192, generator=g).bfloat16()
    v = torch.randn(8, 2, 128, generator=g).bfloat16()
    return q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_kv, dtype=torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_cu_seqlens_values_raise_on_cpu(backend):
    if backend == "triton":
        skip_without_triton_interpreter()
    q, k, v, cu_ok, _ = _attention_thd([0, 4, 8], [0, 4, 8])
    q, k, v, cu_ok = _as(backend, q, k, v, cu_ok)
    dispatch.run("mla_attention", q, k, v, layout="thd", cu_seqlens_q=cu_ok, cu_seqlens_kv=cu_ok, backend=backend)
    for bad, name in (([0, 6, 4], "cu_seqlens_q"), ([0, 4, 9], "cu_seqlens_q")):
        cu_bad = _as(backend, torch.tensor(bad, dtype=torch.int32))[0]
        with pytest.raises(ValueError, match=f"^{name}: must"):
            dispatch.run("mla_attention", q, k, v, layout="thd", cu_seqlens_q=cu_bad, cu_seqlens_kv=cu_ok,
                         backend=backend)


def test_device_index_values_are_checked_only_when_asked(monkeypatch):
    """A tensor off the host (meta stands in for CUDA here) is read only under MXMLA_CHECK_VALUES=1."""
    off_host = torch.empty(3, dtype=torch.int32, device="meta")
    on_host = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert dispatch._values_checked((on_host,), {})
    assert not dispatch._values_checked((off_host,), {})
    assert not dispatch._values_checked((torch.randn(4),), {})  # no index tensor: nothing to read
    monkeypatch.setenv("MXMLA_CHECK_VALUES", "1")
    assert dispatch._values_checked((off_host,), {})
    monkeypatch.setenv("MXMLA_CHECK_VALUES", "0")
    assert not dispatch._values_checked((off_host,), {})
    monkeypatch.setenv("MXMLA_CHECK_VALUES", "yes")
    with pytest.raises(ValueError, match="MXMLA_CHECK_VALUES='yes': expected 0 or 1"):
        dispatch._values_checked((off_host,), {})


def test_check_values_variable_is_part_of_the_cached_choice(monkeypatch):
    x, cos, sin = _rope_inputs(tokens=8, rows=32)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    dispatch.run("rope", x, cos, sin, positions=positions, backend="torch")
    monkeypatch.setenv("MXMLA_CHECK_VALUES", "2")
    with pytest.raises(ValueError, match="MXMLA_CHECK_VALUES"):
        dispatch.run("rope", x, cos, sin, positions=positions, backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_index_checks_raise_instead_of_a_device_assert(monkeypatch, backend):
    """On CUDA: the short table raises from shapes; index values raise under MXMLA_CHECK_VALUES=1; and
    the context stays usable (a device-side assert would poison it for the rest of the process)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    x, cos, sin = (t.cuda() for t in _rope_inputs(tokens=40, rows=32))
    with pytest.raises(ValueError, match="^cos: tables have 32 rows"):
        dispatch.run("rope", x, cos, sin, backend=backend)
    monkeypatch.setenv("MXMLA_CHECK_VALUES", "1")
    x8, cos8, sin8 = x[:8], cos, sin
    bad_pos = torch.tensor([0, 1, 2, 3, 40, 5, 6, 7], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"^positions: value 40 out of range \[0, 32\)"):
        dispatch.run("rope", x8, cos8, sin8, positions=bad_pos, backend=backend)
    bad_cu = torch.tensor([0, 40, 32], dtype=torch.int32, device="cuda")
    xx, cc, ss = (t.cuda() for t in _rope_inputs(tokens=32, rows=64))
    with pytest.raises(ValueError, match="^cu_seqlens: expected non-decreasing"):
        dispatch.run("rope", xx, cc, ss, cu_seqlens=bad_cu, backend=backend)
    good = dispatch.run("rope", xx, cc, ss, backend=backend)
    torch.cuda.synchronize()
    assert good.shape == xx.shape
