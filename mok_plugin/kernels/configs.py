"""Fixed kernel tile configs per shape class: the deterministic path never autotunes.

A config fixes BLOCK_K (the order of every K-loop reduction) and the tile shape (which program owns
which output tile), so two processes that look up the same shape run the same arithmetic. The table
is keyed by a coarse shape class, never by a measurement taken at run time.

How the numbers were chosen: BLOCK_M = 128 rows matches the schedule's segment padding
(`schedule.DEFAULT_TILE_M`) and lowers `tl.dot` to Hopper wgmma with 8 warps; BLOCK_K = 64 bf16
elements is one 128-byte swizzle row. BENCHMARKS.md records the measurements behind each change.
Under the Triton interpreter (CPU tests) small tiles keep numpy work and program counts low.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MoKTileConfig", "gemm_config", "wgrad_config", "combine_config", "interpreter_on"]


@dataclass(frozen=True, slots=True)
class MoKTileConfig:
    """One kernel launch's tile shape and pipelining."""

    block_m: int  # rows (or the first output dim of a weight-gradient tile)
    block_n: int  # output columns
    block_k: int  # reduction step; fixes the order of the K-loop
    num_warps: int
    num_stages: int
    group_m: int = 8  # row blocks that share a column sweep, for L2 reuse of rows and weights


def interpreter_on() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gemm_config(n_out: int, k_dim: int) -> MoKTileConfig:
    """Row-tile GEMMs over the schedule (gate/up, down, and their dgrads).

    Args:
        n_out: output columns (I for gate/up, H for down and dX).
        k_dim: reduction length (H or I or 2I).
    """
    if interpreter_on():
        return MoKTileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
    block_n = 128 if n_out >= 128 else 64
    return MoKTileConfig(block_m=128, block_n=block_n, block_k=64, num_warps=8, num_stages=3)


def wgrad_config(m_out: int, n_out: int) -> MoKTileConfig:
    """Per-expert weight-gradient GEMMs, reducing over the expert's rows in BLOCK_K steps."""
    if interpreter_on():
        return MoKTileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
    return MoKTileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def combine_config(hidden: int) -> MoKTileConfig:
    """The fixed-order sum over k: BLOCK_M tokens by BLOCK_N columns per program."""
    if interpreter_on():
        return MoKTileConfig(block_m=8, block_n=32, block_k=1, num_warps=4, num_stages=1)
    return MoKTileConfig(block_m=8, block_n=256, block_k=1, num_warps=4, num_stages=1)
