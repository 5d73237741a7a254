"""Tile orders shared by the Triton kernels (gemm, mla_q). The Gluon kernels' counterpart is
_gluon_compat.tile_coords: a Gluon kernel cannot call a triton.jit function."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) with GROUP_M consecutive M tiles per N tile: programs running together share
    the B tiles and a small set of A tiles in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n
