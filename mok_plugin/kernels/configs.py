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

from dataclasses import dataclass, replace

from mok_plugin.config import triton_interpreter_from_env

__all__ = [
    "MoKTileConfig",
    "PINNED_KERNELS",
    "FEW_ROWS_MAX",
    "FEW_ROWS_MAX_OUTPUT",
    "PRE_GATHER_MIN_WIDTH",
    "SWEEP_MAX_ROWS",
    "column_tail",
    "interpreter_on",
    "kernel_config",
    "spread_over_sms",
    "swap_pinned",
    "wgrad_config",
    "wgrad_kernel",
    "HOPPER_WGRAD_MIN_WIDTH",
    "HOPPER_WGRAD_REPLACES",
    "SPREAD_MIN_BLOCK_N",
]


@dataclass(frozen=True, slots=True)
class MoKTileConfig:
    """One kernel launch's tile shape and pipelining."""

    block_m: int  # rows (or the first output dim of a weight-gradient tile)
    block_n: int  # output columns
    block_k: int  # reduction step; fixes the order of the K-loop
    num_warps: int
    num_stages: int
    group_m: int = 8  # row blocks that share a column sweep, for L2 reuse of rows and weights
    # Contiguous operands (weights, the schedule-ordered row buffers) through TMA tensor
    # descriptors where the shapes allow it (rows of a multiple of 16 bytes). The same tiles and K
    # order as pointer loads; whether it is used depends on shapes only, so every process decides alike.
    tma: bool = False
    # Weight gradients: copy the by-token operand (x or dO) into schedule row order before the GEMM,
    # a column block at a time (grouped_mlp.GATHER_CHUNK_BYTES), so both operands are contiguous
    # (TMA). Without it the K loop gathers the rows itself (their indices loaded a step ahead, so it
    # still pipelines num_stages deep). Same products in the same order either way.
    gather_rows: bool = False
    # Weight gradients: one program per (expert, row block) sweeps that block's output tiles in one
    # loop over (tile, K step), so a tile's store and the next tile's first loads overlap
    # (tiles.wgrad_sweep); without it a program per output tile. Same sums in the same order.
    sweep: bool = False


def interpreter_on() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, or true, on, yes)."""
    return triton_interpreter_from_env()


# Pinned per kernel (bf16/fp16 on Hopper). Chosen from scripts/tune_kernels.py on the H200 over
# qwen3-30b-a3b and mixtral-8x7b (BENCHMARKS.md, "kernel tuning"): the best of six candidates for
# each kernel, one entry for both shapes where they agreed.
_TABLE: dict[str, MoKTileConfig] = {
    # 128 gate and 128 up columns: one 128x256 fp32 accumulator over both halves of one TMA load
    # (grouped_mlp.JOIN_GATE_UP; pointer loads: two accumulators). The forward's weights (and fc2's
    # A rows) through TMA, 4 stages: fwd+bwd 0.953-0.984 of pointer loads at 3 stages on
    # qwen3-30b-a3b, mixtral-8x7b and gpt-oss-120b (session 49, H100; gate_up_fwd 1.73 -> 1.56 ms
    # and down_fwd 0.89 -> 0.81 on qwen3).
    "gate_up_fwd": MoKTileConfig(128, 128, 64, 8, 4, tma=True),
    # A non-gated (mlp) expert's fc1: one accumulator, so the tile takes down_fwd's 128x256.
    "mlp_up_fwd": MoKTileConfig(128, 256, 64, 8, 3),
    "down_fwd": MoKTileConfig(128, 256, 64, 8, 4, tma=True),
    # down_dgrad is a plain GEMM into an fp32 dA' and a separate elementwise epilogue kernel
    # (dSwiGLU, router partials, w*A). Fused into the GEMM the epilogue held the tile to 128x64
    # accumulators (255 registers); split, the GEMM takes down_fwd's 128x256 tile (BENCHMARKS.md).
    "down_dgrad": MoKTileConfig(128, 256, 64, 8, 3),
    # The epilogue kernel: block_m rows x block_n columns (its router partials are block_n wide) in
    # num_warps warps; no K loop. 32x128 in 8 warps was the fastest of 32x64 w4, 16x64, 64x64 and
    # 64x128 on the four named shapes (0.49 / 0.66 / 1.06 / 0.73 ms, 3.0-3.9 TB/s).
    "down_dgrad_epilogue": MoKTileConfig(32, 128, 1, 8, 1),
    # TMA, 4 stages: 1.48 -> 1.45 ms (qwen3-30b-a3b), 6.02 -> 5.75 ms (mixtral-8x7b).
    "gate_up_dgrad": MoKTileConfig(128, 256, 64, 8, 4, tma=True),
    # Weight gradients whose by-row operand is at least PRE_GATHER_MIN_WIDTH wide: the by-token
    # operand (x, dO) pre-gathered into row order, a column block at a time, then TMA. The copy is
    # then a small part of the GEMM: mixtral-8x7b dW2 3.30 ms, against 3.51-3.61 gathered in the loop.
    "wgrad": MoKTileConfig(128, 128, 64, 8, 3, tma=True, gather_rows=True),
    # Narrower ones: the by-token rows gathered inside the K loop (their indices loaded a step
    # ahead, so it pipelines num_stages deep), no copy. dW2: qwen3-30b-a3b 1.08 -> 0.83 ms,
    # olmoe 1.34 -> 1.11, deepseek-v3 6.25 -> 6.14 (BENCHMARKS.md, "kernel tuning").
    "wgrad_in_loop": MoKTileConfig(128, 256, 64, 8, 3, tma=True),
    # Either weight gradient when the experts have few rows each (at most SWEEP_MAX_ROWS schedule rows
    # per expert): a program per (expert, row block) sweeps its tiles, the by-token rows gathered in
    # the loop (no copy). Alone, against the entries above (ms, dW13 / dW2): deepseek-v3 (383 rows
    # an expert) 12.37 / 5.89 -> 9.68 / 4.81; gpt-oss-120b (639) 5.03 / 2.71 -> 4.60 / 2.54;
    # 4096,7168,2048,384,8 (212) 12.29 / 6.61 -> 9.76 / 4.81 (s3); qwen3-30b-a3b (1151) lost 11-20 % (s3).
    "wgrad_sweep": MoKTileConfig(128, 256, 64, 8, 4, tma=True, sweep=True),
    # The sweep when the experts have at most FEW_ROWS_MAX schedule rows each (small batches: one or
    # two K steps per tile, the time in the stores): 64x128 in 4 warps, twice the programs of 128x256
    # in 8. qwen3-30b-a3b's dimensions, dW13 / dW2 alone: T = 37 0.458 / 0.242 -> 0.379 / 0.258 ms,
    # T = 512 0.390 / 0.232 -> 0.353 / 0.221 ms (BENCHMARKS.md, "Where the time goes, settled").
    "wgrad_sweep_few_rows": MoKTileConfig(64, 128, 64, 4, 4, tma=True, sweep=True),
    # The megakernel's down-dgrad tasks run the GEMM and the epilogue in one tile (one launch has
    # no second kernel to hand dA' to): 128x64, the widest whose epilogue fits the registers.
    "megakernel_down_dgrad": MoKTileConfig(128, 64, 64, 8, 3),
    # The megakernel's weight-gradient tasks gather by-token rows in the loop, inside one launch
    # whose registers fit every task; its stages are the launch's, so they apply to every task.
    "megakernel_wgrad": MoKTileConfig(128, 128, 64, 8, 3),
    "combine": MoKTileConfig(8, 256, 1, 4, 1),
}
PINNED_KERNELS = tuple(_TABLE)
# Kernels whose tile does not depend on the output width: the weight gradients and combine.
_NEVER_NARROWED = frozenset(
    {"combine", "wgrad", "wgrad_in_loop", "wgrad_sweep", "wgrad_sweep_few_rows", "megakernel_wgrad",
     "megakernel_down_dgrad", "down_dgrad_epilogue"}
)  # fmt: skip
_INTERPRETER = MoKTileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
_INTERPRETER_COMBINE = MoKTileConfig(block_m=8, block_n=32, block_k=1, num_warps=4, num_stages=1)


# dW = left^T right per expert, one operand read by token: below this width of the by-row operand
# the K loop gathers the by-token rows itself ("wgrad_in_loop"); from it on they are copied first
# ("wgrad"). A copy costs the same for any width, the GEMM grows with it.
PRE_GATHER_MIN_WIDTH = 4096
# At most this many schedule rows per expert (padding included: R_pad / E, known on the host), the
# weight gradients sweep ("wgrad_sweep"): each output tile then sums 16 K steps or fewer, and a
# program per tile would spend much of its time filling its pipeline and storing. The choice
# changes no bits (the sweep sums every tile in the same order), only the time.
SWEEP_MAX_ROWS = 1024
# At most this many (T <= 512 with qwen3-30b-a3b's dimensions: 130-160), the sweep's small tiles,
# where each expert's gradient has fewer than FEW_ROWS_MAX_OUTPUT elements: their edge is more
# programs on small matrices (qwen3-30b-a3b's 1536 x 2048 and 2048 x 768). On large ones
# (4096,7168,2048,384,8: 213 rows an expert, 4096 x 7168 and 7168 x 2048) the weight gradients took
# 18.6 ms with them, 17.6 with wgrad_sweep's tiles and 16.2 with wgrad_sweep and its Gluon kernel
# for dW2; the layer 41.57 -> 38.71 ms (BENCHMARKS.md, "Where the time goes at 6e7755e").
FEW_ROWS_MAX = 256
FEW_ROWS_MAX_OUTPUT = 2**23


def wgrad_kernel(by_row_width: int, rows_per_expert: int, output_per_expert: int) -> str:
    """The table entry of a weight gradient whose by-row operand (w*A or dh) is this many columns
    wide, over a schedule of this many rows (padding included) per expert, each expert's gradient
    having output_per_expert elements (M x N)."""
    if rows_per_expert <= FEW_ROWS_MAX and output_per_expert < FEW_ROWS_MAX_OUTPUT:
        return "wgrad_sweep_few_rows"
    if rows_per_expert <= SWEEP_MAX_ROWS:
        return "wgrad_sweep"
    return "wgrad" if by_row_width >= PRE_GATHER_MIN_WIDTH else "wgrad_in_loop"


# Where the Gluon kernel for Hopper (wgrad_hopper.py, same bits) takes over from these entries,
# under which of its schedules, and from what width of the by-row operand: it needs the by-token
# rows copied into row order first, which pays where the GEMM per row is wide. Measured in the
# layer (GPU time of the weight gradients, Triton -> Gluon + copies, ms): deepseek-v3 16.35 ->
# 12.07 + 1.26 (ping-pong; 13.77 cooperative), mixtral-8x7b 9.09 -> 8.26 + 0.14 (cooperative;
# 8.63 ping-pong), gpt-oss-120b 6.67 -> 5.56 + 0.44 (ping-pong; 5.87 cooperative) (by-row widths
# 2048 and more); slower on 8192,3000,1000,160,6 (2.35 -> 2.36 + 0.35 ping-pong; widths 2000 and
# 1000), qwen3-30b-a3b (2.21 -> 1.97 + 0.72) and olmoe (2.67 -> 2.43 + 0.68): the copies cost what
# the GEMM gains. BENCHMARKS.md, "Weight gradients in Gluon" and "Ping-pong weight gradients".
HOPPER_WGRAD_REPLACES = {"wgrad": "cooperative", "wgrad_sweep": "pingpong"}
HOPPER_WGRAD_MIN_WIDTH = 2048


def wgrad_config(by_row_width: int, num_rows: int, num_experts: int, output_per_expert: int) -> MoKTileConfig:
    """The pinned config of a weight gradient whose by-row operand is this many columns wide, over a
    schedule of num_rows rows (R_pad, padding included) for num_experts experts, each expert's
    gradient having output_per_expert elements."""
    entry = wgrad_kernel(by_row_width, num_rows // max(num_experts, 1), output_per_expert)
    return kernel_config(entry, by_row_width)


def kernel_config(kernel: str, n_out: int) -> MoKTileConfig:
    """The pinned config of `kernel` for an output n_out columns wide.

    The only shape rule: a row-tile GEMM's BLOCK_N shrinks (to a power of two, at least 64) when
    the output is narrower than the table's tile, so small layers do not compute mostly-masked
    tiles. The weight-gradient tiles never change (wgrad_kernel picks one of the four).

    Raises:
        KeyError: an unknown kernel name.
    """
    if interpreter_on():  # small tiles, but the same loop structure (the sweep) as on the GPU
        return _INTERPRETER_COMBINE if kernel == "combine" else replace(_INTERPRETER, sweep=_TABLE[kernel].sweep)
    cfg = _TABLE[kernel]
    if kernel not in _NEVER_NARROWED and n_out < cfg.block_n:
        narrow = max(64, 1 << max(0, (n_out - 1).bit_length()))
        if narrow < cfg.block_n:
            cfg = replace(cfg, block_n=narrow)
    return cfg


# A row GEMM whose launch has fewer programs than the GPU has SMs takes narrower tiles, down to this
# width: at T = 1 with top-8 each row GEMM has one row block per routed expert, so 128 x 256 tiles
# give 8 x cdiv(n, 256) programs (24-64 of the H200's 132 SMs), each streaming its expert's weights
# alone; narrower ones spread the same bytes over more SMs.
SPREAD_MIN_BLOCK_N = 64


def spread_over_sms(cfg: MoKTileConfig, row_blocks: int, n_out: int, sms: int) -> MoKTileConfig:
    """cfg with BLOCK_N halved, to SPREAD_MIN_BLOCK_N at least, while a launch over row_blocks row
    blocks and n_out columns would have fewer programs than sms. A tile's width changes no bits
    (every output sums its BLOCK_K steps in ascending order at any width), so a token's output is
    the same whatever the batch picks (tests/test_gpu_layer.py)."""
    while cfg.block_n > SPREAD_MIN_BLOCK_N and 0 < row_blocks * -(-n_out // cfg.block_n) < sms:
        cfg = replace(cfg, block_n=cfg.block_n // 2)
    return cfg


# A row GEMM's last column block, where the output's width leaves it mostly empty (gpt-oss-120b's
# 2880 = 11 x 256 + 64, or 22 x 128 + 64 for fc1's halves): its MMAs run over the whole BLOCK_N all
# the same, 1/12 of the work of three of its four row GEMMs for 64 of 2880 columns. Launched on its
# own at a narrower tile, it costs about its width (v46). gpt-oss-120b on an H100, three A/Bs:
# fwd+bwd B/A 0.976-0.988, gate_up_dgrad -8 to -10 %, down_dgrad's GEMM -1 to -4 %, the forward's
# two within their +-2 % noise; the same bits (a tile's width changes none).
SPLIT_COLUMN_TAIL = True


def column_tail(cfg: MoKTileConfig, n_out: int) -> MoKTileConfig | None:
    """The config for a row GEMM's last, partial column block launched on its own (SPLIT_COLUMN_TAIL):
    cfg at the narrowest power-of-two BLOCK_N (SPREAD_MIN_BLOCK_N or half cfg's, at least) that holds the columns
    left past the full blocks, where that is narrower than cfg's; else None (one launch)."""
    full, rest = divmod(n_out, cfg.block_n)
    if not SPLIT_COLUMN_TAIL or full == 0 or rest == 0:
        return None
    narrowest = min(SPREAD_MIN_BLOCK_N, cfg.block_n // 2)  # the interpreter's tiles are 32 wide
    block_n = max(narrowest, 1 << (rest - 1).bit_length())
    return replace(cfg, block_n=block_n) if block_n < cfg.block_n else None


def swap_pinned(entries: dict[str, MoKTileConfig]) -> dict[str, MoKTileConfig]:
    """Put `entries` into the pinned table and return the entries they replaced, for a benchmark
    comparing candidate tables in one process (mok_plugin.bench.tuning.overridden_configs). Not for
    training: every process must use the same table.

    Raises:
        KeyError: a kernel the table does not have (nothing is replaced then).
    """
    unknown = set(entries) - set(PINNED_KERNELS)
    if unknown:
        raise KeyError(f"no pinned config for {sorted(unknown)}; kernels: {', '.join(PINNED_KERNELS)}")
    previous = {name: _TABLE[name] for name in entries}
    _TABLE.update(entries)
    return previous
