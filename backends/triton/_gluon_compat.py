"""What the sm90 Gluon kernels (mla_q_gluon.py, gemm_gluon.py) share: the few Gluon calls whose
spelling differs between Triton 3.6 and 3.9, and their grouped tile order.

Gluon is experimental and its API moves between releases. Of what these kernels use, 3.6 and 3.9
differ in (compared name by name in both wheels' triton/experimental/gluon):
- the TMA copies: 3.6 `tma.async_copy_global_to_shared` / `tma.async_copy_shared_to_global`, 3.9
  `tma.async_load` / `tma.async_store` (the old names raise "has been removed");
- the CTA barrier: 3.6 `gl.thread_barrier()`, 3.9 `gl.barrier()` (both lower to one bar.sync);
- a shared-memory view as another dtype / shape: 3.6 `desc._reinterpret(dtype, shape, layout)`,
  3.9 `desc.reinterpret(dtype, shape, layout)`;
- `tma.store_wait(n)`: 3.9 adds `read_only` (default True: wait until the stores have read their
  shared-memory source, as 3.6's only form does; cp.async.bulk.wait_group.read in both).
The names below are the 3.9 spelling, bound to whichever the installed Triton has; everything else
the kernels call (layouts, mbarrier, warpgroup_mma, warp_specialize) has one signature in both, with
only optional arguments added in 3.9. Other releases are not gated in: SUPPORTED_TRITON.

The kernels run on an H200 with Triton 3.6; with 3.9 they are compiled offline for sm90 in CI
(tests/test_gluon_compile.py) but have not run on a GPU.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin, shared_memory_descriptor
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

SUPPORTED_TRITON = ("3.6.", "3.9.")

_NEW_TMA_NAMES = hasattr(tma, "async_load") and hasattr(tma, "async_store")
async_load = tma.async_load if _NEW_TMA_NAMES else tma.async_copy_global_to_shared
async_store = tma.async_store if _NEW_TMA_NAMES else tma.async_copy_shared_to_global
barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_PUBLIC_REINTERPRET = hasattr(shared_memory_descriptor, "reinterpret")


@builtin
def reinterpret(buf, dtype, shape, layout, _semantic=None):
    """buf (a shared-memory descriptor) viewed with another dtype, shape and layout."""
    method = buf.reinterpret if _PUBLIC_REINTERPRET else buf._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)


def version_reasons() -> list:
    """Why this Triton cannot build the Gluon kernels (empty when it can)."""
    if triton.__version__.startswith(SUPPORTED_TRITON):
        return []
    return [f"the Gluon kernels support Triton {' and '.join(v + 'x' for v in SUPPORTED_TRITON)}, "
            f"this is {triton.__version__}"]


@gluon.jit
def tile_coords(tile, num_m, H, GROUP_M: gl.constexpr):
    """(token tile, head) of a tile index in grouped order: GROUP_M token tiles per head run together
    (the group's x tiles stay in L2 while the heads' w stream through)."""
    per_group = GROUP_M * H
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """(ready, empty) mbarriers of a STAGES-slot TMA ring: a slot is ready once its loads land (one
    producer arrival plus the bytes), and empty once each of CONSUMERS warpgroups has arrived."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty
