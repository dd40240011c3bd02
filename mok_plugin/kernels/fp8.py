"""Triton building blocks of blockwise FP8 (mok_plugin/fp8): rounding onto an FP8 grid and the scale
of a block, so that the kernels quantise exactly as `mok_plugin.fp8.quantize` defines.

Compiled for sm_90 or later, the GPU's conversion rounds (`cvt.rn.satfinite`: to nearest even,
saturating at +-MAX, one instruction for two values). Triton's CPU interpreter mis-converts fp32
values whose rounding carries into the next power of two (7.89 became 4.0 instead of 8.0 in E4M3),
and sm_89 converts through f16 (two roundings), so there the values are rounded by hand with fp32
arithmetic first (the cast that follows has nothing left to round): the same bits every way, the
quantisers' (`quantize.fp8_round`), NaN aside.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import triton
import triton.language as tl
from triton.language.target_info import current_target
from triton.runtime.jit import constexpr_function

from mok_plugin.fp8.recipe import FP8Format
from mok_plugin.kernels.configs import interpreter_on
from mok_plugin.kernels.launch import cdiv, check_tensor

__all__ = [
    "block_scale",
    "fp8_of",
    "quantize_block",
    "quantize_fc1",
    "quantize_gathered_columns",
    "quantize_rows",
    "quantize_weights",
    "round_to_fp8_grid",
    "scale_inverse",
    "transposed_copy",
]


# Decided when the module is imported, as Triton decides whether its kernels are interpreted.
COMPILED = tl.constexpr(not interpreter_on())


@constexpr_function
def conversion_rounds_once() -> bool:
    """Whether the GPU the kernels compile for converts fp32 to FP8 in one rounding (cvt.rn.satfinite
    from f32: sm_90 and later; sm_89's goes through f16, rounding twice). Without a GPU (a compile for
    sm_90 that inspects the code), yes."""
    target = current_target()
    return target is None or (target.backend == "cuda" and target.arch >= 90)


@triton.jit
def round_to_fp8_grid(v, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXPONENT: tl.constexpr):
    """fp32 v clamped to +-MAX and rounded to nearest even on the FP8 grid (MANTISSA_BITS bits below
    the leading one; a fixed step of 2^(MIN_NORMAL_EXPONENT - MANTISSA_BITS) below the smallest normal).
    NaN is not kept (a NaN block's scale is NaN anyway): by hand it becomes a number, the conversion
    gives the format's NaN.

    Compiled for sm_90 or later: the conversion to E4M3 (448) or E5M2 (57344) and back (11 instructions
    a value by hand, ~2 so). Otherwise: |v| + C, where C is the grid step times 2^23, lands in the
    binade of C, whose fp32 spacing is the step: fp32's own round-to-nearest-even does the rounding,
    and subtracting C is exact."""
    if COMPILED and conversion_rounds_once():
        tl.static_assert((MANTISSA_BITS == 3 and MAX == 448.0) or (MANTISSA_BITS == 2 and MAX == 57344.0))
        if MANTISSA_BITS == 3:
            return v.to(tl.float32).to(tl.float8e4nv).to(tl.float32)
        else:
            return v.to(tl.float32).to(tl.float8e5).to(tl.float32)
    magnitude = tl.minimum(tl.abs(v.to(tl.float32)), MAX)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_NORMAL_EXPONENT)
    c = ((exponent - MANTISSA_BITS + 23 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + c) - c
    # v's sign bit put back by hand: a compiled `-rounded` is 0 - rounded, which loses -0.0 (a tiny
    # negative value that rounds to zero), where the cast and the interpreter keep it
    sign = v.to(tl.float32).to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_of(v, DTYPE: tl.constexpr, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXPONENT: tl.constexpr):
    """fp32 v in the FP8 DTYPE (the format of MAX and MANTISSA_BITS), rounded as round_to_fp8_grid rounds.
    Compiled for sm_90 or later by the conversion alone: `round_to_fp8_grid(v).to(DTYPE)` converts there
    to FP8, back to fp32 and to FP8 again (~2 instructions a value more; the compiler keeps all three)."""
    if COMPILED and conversion_rounds_once():
        tl.static_assert((MANTISSA_BITS == 3 and MAX == 448.0) or (MANTISSA_BITS == 2 and MAX == 57344.0))
        q = v.to(tl.float32).to(DTYPE)
    else:
        q = round_to_fp8_grid(v, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT).to(DTYPE)
    return q


@triton.jit
def block_scale(amax, MAX: tl.constexpr, POWER_OF_2: tl.constexpr, FROM_BITS: tl.constexpr = True):
    """fp32 scale of blocks whose largest magnitude is amax: MAX / amax (1 where amax is 0, the
    largest finite fp32 where that overflows), its mantissa cleared when POWER_OF_2 (quantize.block_scales).
    FROM_BITS=False: a power of two by IEEE division too (the same bits)."""
    # MAX as a tensor by `where`, not tl.full: Gluon kernels import these functions (fp8_hopper.py), and
    # Gluon's full needs a layout; the same constant either way.
    nonzero = amax > 0
    max_value = tl.where(nonzero, MAX, MAX)
    if POWER_OF_2 and FROM_BITS:
        # The IEEE quotient's exponent, from the exponents and mantissas: MAX / amax lies in
        # [2^(eM - ea), 2^(eM - ea + 1)) when amax's mantissa is at most MAX's, else one binade lower
        # (never rounded up into the next: the quotient's distance below it is at least 2^-24 of it,
        # over half an ulp); an overflow (at most 2^127 once cleared) and a subnormal amax clamp at
        # 2^127. Integer work where the division cost ~10 instructions and a slow-path branch (sm_90).
        bits = amax.to(tl.int32, bitcast=True)
        max_bits = max_value.to(tl.int32, bitcast=True)
        binade_lower = ((bits & 0x7FFFFF) > (max_bits & 0x7FFFFF)).to(tl.int32)
        exponent = tl.minimum((max_bits >> 23) - ((bits >> 23) & 0xFF) + 127 - binade_lower, 254)
        scale = tl.where(nonzero, (exponent << 23).to(tl.float32, bitcast=True), 1.0)
        return tl.where(amax == float("inf"), 0.0, scale)  # MAX / inf
    else:
        # IEEE division: the compiled `/` is approximate, and an amax of exactly MAX / 2^k must give 2^k.
        scale = tl.where(nonzero, tl.div_rn(max_value, tl.where(nonzero, amax, 1.0)), 1.0)
        scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
        if POWER_OF_2:
            scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
        return scale


@triton.jit
def scale_inverse(scale, POWER_OF_2: tl.constexpr, FROM_BITS: tl.constexpr = True):
    """1 / scale, as IEEE division gives it, of block_scale's scales (scale_inv: what dequantises);
    FROM_BITS=False: by the division for powers of two too."""
    if POWER_OF_2 and FROM_BITS:  # 2^k's inverse 2^-k from its exponent: 2^-127 subnormal, 1 / 0 (amax inf) inf
        biased = scale.to(tl.int32, bitcast=True) >> 23
        inverse = tl.where(biased == 254, 0x400000, tl.where(biased == 0, 0x7F800000, (254 - biased) << 23))
        return inverse.to(tl.float32, bitcast=True)
    else:  # IEEE, as quantize_1d's 1 / scale
        return tl.div_rn(tl.where(scale > 0, 1.0, 1.0), scale)


@triton.jit
def quantize_block(v, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXPONENT: tl.constexpr,
                   POWER_OF_2: tl.constexpr, AXIS: tl.constexpr, FROM_BITS: tl.constexpr = True,
                   STORED: tl.constexpr = None):  # fmt: skip
    """(values on the FP8 grid, fp32 scale_inv) of a 2-D fp32 tile quantised in blocks that are its
    rows (AXIS 1), its columns (AXIS 0) or the whole tile (AXIS None); FROM_BITS: block_scale's.
    STORED (an FP8 dtype): the values in it, for a store (`fp8_of`), instead of fp32."""
    amax = tl.max(tl.abs(v), axis=AXIS)
    scale = block_scale(amax, MAX, POWER_OF_2, FROM_BITS)
    if AXIS == 1:
        scaled = v * scale[:, None]
    elif AXIS == 0:
        scaled = v * scale[None, :]
    else:
        scaled = v * scale
    scale_inv = scale_inverse(scale, POWER_OF_2, FROM_BITS)
    if STORED is None:
        q = round_to_fp8_grid(scaled, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT)
    else:
        q = fp8_of(scaled, STORED, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT)
    return q, scale_inv


@triton.jit
def _quantize_rows_kernel(
    src_ptr,
    data_ptr,
    scale_inv_ptr,
    M,
    N,
    stride_src,
    stride_data,
    stride_scale,
    MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXPONENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK)); program (m, b) quantises block b of its BLOCK_M rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    v = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale_inv = quantize_block(v, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2, 1,
                                  STORED=data_ptr.dtype.element_ty)  # fmt: skip
    tl.store(data_ptr + rows[:, None] * stride_data + cols[None, :], q, mask=mask)
    tl.store(scale_inv_ptr + rows * stride_scale + tl.program_id(1), scale_inv, mask=rows < M)


@triton.jit
def _quantize_tiles_kernel(
    src_ptr, data_ptr, scale_inv_ptr, data_t_ptr, R, C, stride_src_e, stride_src_r, stride_data_e, stride_data_r,
    stride_scale_e, stride_scale_r, stride_t_e, stride_t_c, MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXPONENT: tl.constexpr, POWER_OF_2: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    HALVES: tl.constexpr,
):  # fmt: skip
    """Grid: (E, cdiv(R, BLOCK), cdiv(C, BLOCK)); program (e, i, j) quantises tile (i, j) of matrix e.
    With data_t_ptr it also stores the tile transposed (the same bytes; a square tile's scale is its
    transpose's): matrix e's [C, R] transpose at column (e % HALVES) * R of transposed matrix e // HALVES,
    so a glu's two halves, quantised as two matrices, sit side by side as in transposed_copy's result.

    CHUNK rows at a time, twice (the tile's amax, then its values; the second read from L2): the whole
    128 x 128 fp32 tile in registers took 167 of them in 4 warps, and with the transposed store 255
    and 400 bytes of stack; in 16 warps 64, no stack (sm_90 compiles, Triton 3.6; TILE_QUANTISER_*).
    max is exact, so the bits are quantize_block's for any CHUNK."""
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    col_ok = (cols < C)[None, :]
    src = src_ptr + e * stride_src_e + cols[None, :]
    magnitudes = tl.zeros((CHUNK, BLOCK), dtype=tl.float32)
    for r0 in tl.static_range(0, BLOCK, CHUNK):  # unrolled: the whole tile's loads in flight at once
        rows = tl.program_id(1).to(tl.int64) * BLOCK + r0 + tl.arange(0, CHUNK)
        part = tl.load(src + rows[:, None] * stride_src_r, mask=(rows < R)[:, None] & col_ok, other=0.0)
        magnitudes = tl.maximum(magnitudes, tl.abs(part.to(tl.float32)))
    scale = block_scale(tl.max(magnitudes), MAX, POWER_OF_2)
    for r0 in range(0, BLOCK, CHUNK):
        rows = tl.program_id(1).to(tl.int64) * BLOCK + r0 + tl.arange(0, CHUNK)
        mask = (rows < R)[:, None] & col_ok
        v = tl.load(src + rows[:, None] * stride_src_r, mask=mask, other=0.0).to(tl.float32)
        q = fp8_of(v * scale, data_ptr.dtype.element_ty, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT)
        tl.store(data_ptr + e * stride_data_e + rows[:, None] * stride_data_r + cols[None, :], q, mask=mask)
        if data_t_ptr is not None:
            data_t = data_t_ptr + (e // HALVES) * stride_t_e + (e % HALVES) * R
            tl.store(data_t + cols[:, None].to(tl.int64) * stride_t_c + rows[None, :], tl.trans(q),
                     mask=tl.trans(mask))  # fmt: skip
    scale_inv = scale_inverse(scale, POWER_OF_2)
    tl.store(scale_inv_ptr + e * stride_scale_e + tl.program_id(1) * stride_scale_r + tl.program_id(2), scale_inv)


def quantize_rows(
    src: torch.Tensor, fmt: FP8Format, block: int = 128, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_1d(src, fmt, block, dim=-1)` in one launch: (data [M, N] in fmt.dtype, fp32 scale_inv
    [M, cdiv(N, block)]) of a 2-D src whose rows are contiguous (x, dO: 1 x 128 blocks along H)."""
    check_tensor("src", src, 2)
    M, N = src.shape
    blocks = cdiv(N, block)
    data = torch.empty(M, N, dtype=fmt.dtype, device=src.device)
    scale_inv = torch.empty(M, blocks, dtype=torch.float32, device=src.device)
    block_m = 8 if interpreter_on() else 32
    if M and N:
        _quantize_rows_kernel[(cdiv(M, block_m), blocks)](
            src, data, scale_inv, M, N, src.stride(0), data.stride(0), scale_inv.stride(0), fmt.max,
            fmt.mantissa_bits, fmt.min_normal_exponent, power_of_2, BLOCK_M=block_m, BLOCK=block,
        )  # fmt: skip
    return data, scale_inv


Copy = tuple[torch.Tensor, torch.Tensor]  # (FP8 values, fp32 scale_inv)


@overload
def quantize_weights(w: torch.Tensor, fmt: FP8Format, block: int = ..., power_of_2: bool = ..., *,
                     with_transpose: Literal[False] = ...) -> Copy: ...  # fmt: skip
@overload
def quantize_weights(w: torch.Tensor, fmt: FP8Format, block: int = ..., power_of_2: bool = ..., *,
                     with_transpose: Literal[True]) -> tuple[Copy, Copy]: ...  # fmt: skip
def quantize_weights(
    w: torch.Tensor, fmt: FP8Format, block: int = 128, power_of_2: bool = True, *, with_transpose: bool = False
) -> Copy | tuple[Copy, Copy]:
    """`quantize_2d(w, fmt, block)` in one launch: (data in fmt.dtype shaped as w, fp32 scale_inv
    [E, cdiv(R, block), cdiv(C, block)]) of experts' weights w [E, R, C] (or one matrix [R, C]),
    made once per step. with_transpose: (that copy, `transposed_copy(*copy)`) from the same pass over
    w, which the backward's dgrads read (one read of the bf16 weights instead of two passes)."""
    return _quantize_tiles(w, fmt, block, power_of_2, halves=1, with_transpose=with_transpose)


@overload
def quantize_fc1(w13: torch.Tensor, fmt: FP8Format, gated: bool, block: int = ..., power_of_2: bool = ..., *,
                 with_transpose: Literal[False] = ...) -> Copy: ...  # fmt: skip
@overload
def quantize_fc1(w13: torch.Tensor, fmt: FP8Format, gated: bool, block: int = ..., power_of_2: bool = ..., *,
                 with_transpose: Literal[True]) -> tuple[Copy, Copy]: ...  # fmt: skip
def quantize_fc1(
    w13: torch.Tensor, fmt: FP8Format, gated: bool, block: int = 128, power_of_2: bool = True, *,
    with_transpose: bool = False,
) -> Copy | tuple[Copy, Copy]:  # fmt: skip
    """(data [E, N1, H] in fmt.dtype, fp32 scale_inv [E, halves, cdiv(N1 / halves, block), cdiv(H, block)])
    of the experts' fc1 weights, a glu's gate and up halves quantised as two matrices (so that blocks
    line up with the halves for any I; fp8/reference.py). with_transpose: also its `transposed_copy`
    ([E, H, N1], the halves side by side), from the same pass."""
    E, N1, H = w13.shape
    halves = 2 if gated else 1
    made = _quantize_tiles(w13.reshape(E * halves, N1 // halves, H), fmt, block, power_of_2, halves, with_transpose)

    def with_halves(data: torch.Tensor, scale_inv: torch.Tensor) -> Copy:  # the scales' halves as a dimension
        return data, scale_inv.view(E, halves, *scale_inv.shape[1:])

    if not with_transpose:
        data, scale_inv = made
        return with_halves(data.view(E, N1, H), scale_inv)
    (data, scale_inv), transposed = made
    return with_halves(data.view(E, N1, H), scale_inv), with_halves(*transposed)


# rows of a weight tile quantised at a time, and the warps (_quantize_tiles_kernel). The whole tile in
# 16 warps: 64 registers, no stack (sm_90, with the transposed store); on an H100 (session 41,
# out/probe_quant.py, the same bits for every setting) the weights of deepseek-v3 and mixtral-8x7b
# with their transposes at 2.67 TB/s, against 1.97 in 32-row chunks and 8 warps (22.9 -> 16.9 ms,
# 2.84 -> 2.11); the whole tile in 8 warps as fast (124 registers), smaller chunks slower (16 rows:
# 0.9 TB/s).
TILE_QUANTISER_CHUNK = 128
TILE_QUANTISER_WARPS = 16


def _quantize_tiles(
    w: torch.Tensor, fmt: FP8Format, block: int, power_of_2: bool, halves: int, with_transpose: bool
) -> Copy | tuple[Copy, Copy]:
    """quantize_weights' launch; the transposed values go into [E / halves, C, halves * R] (the matrices
    that are one expert's halves side by side), their scales are the tile scales transposed."""
    matrices = w if w.dim() == 3 else w.unsqueeze(0)
    check_tensor("w", matrices, 3)
    E, R, C = matrices.shape
    data = torch.empty(E, R, C, dtype=fmt.dtype, device=w.device)
    scale_inv = torch.empty(E, cdiv(R, block), cdiv(C, block), dtype=torch.float32, device=w.device)
    data_t = torch.empty(E // halves, C, halves * R, dtype=fmt.dtype, device=w.device) if with_transpose else None
    t_strides = data_t.stride()[:2] if data_t is not None else (0, 0)
    if matrices.numel():
        _quantize_tiles_kernel[(E, scale_inv.shape[1], scale_inv.shape[2])](
            matrices, data, scale_inv, data_t, R, C, matrices.stride(0), matrices.stride(1), data.stride(0),
            data.stride(1), scale_inv.stride(0), scale_inv.stride(1), *t_strides, fmt.max, fmt.mantissa_bits,
            fmt.min_normal_exponent, power_of_2, BLOCK=block, CHUNK=TILE_QUANTISER_CHUNK, HALVES=halves,
            num_warps=TILE_QUANTISER_WARPS,
        )  # fmt: skip
    copy = (data[0], scale_inv[0]) if w.dim() == 2 else (data, scale_inv)
    if not with_transpose:
        return copy
    scale_inv_t = scale_inv.transpose(-1, -2).contiguous()
    transposed = (data_t[0], scale_inv_t[0]) if w.dim() == 2 else (data_t, scale_inv_t)
    return copy, transposed


@triton.jit
def _quantize_gathered_columns_kernel(
    src_ptr, row_to_token_ptr, data_ptr, scale_inv_ptr, N, stride_src, stride_data, stride_scale, MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXPONENT: tl.constexpr, POWER_OF_2: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid: (R_pad / BLOCK, cdiv(N, BLOCK_N)); program (b, n) quantises row block b of the gathered
    rows (padding rows: zeros) in BLOCK x 1 blocks, columns n-block, and stores them transposed."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    tokens = tl.load(row_to_token_ptr + rows)
    v = tl.load(src_ptr + tokens[:, None] * stride_src + cols[None, :], mask=(tokens >= 0)[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    q, scale_inv = quantize_block(v, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT, POWER_OF_2, 0,
                                  STORED=data_ptr.dtype.element_ty)  # fmt: skip
    tl.store(data_ptr + cols[None, :] * stride_data + rows[:, None], q, mask=col_ok[None, :])
    tl.store(scale_inv_ptr + tl.program_id(0) * stride_scale + cols, scale_inv, mask=col_ok)


def quantize_gathered_columns(
    src: torch.Tensor, row_to_token: torch.Tensor, fmt: FP8Format, block: int = 128, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [N, R_pad] in fmt.dtype, fp32 scale_inv [R_pad / block, N]): the rows of src [T, N] in
    schedule order (src[row_to_token[r]], zeros on padding rows), quantised in block x 1 blocks along
    the rows and stored transposed (the rows contiguous: K-major for the weight gradients, which
    reduce over them): their by-token operands x and dO. Segments must start at multiples of `block`,
    so that a block holds one expert's rows."""
    check_tensor("src", src, 2)
    num_rows, N = row_to_token.shape[0], src.shape[1]
    if num_rows % block:
        raise ValueError(f"{num_rows} schedule rows: not a whole number of {block}-row blocks")
    data = torch.empty(N, num_rows, dtype=fmt.dtype, device=src.device)
    scale_inv = torch.empty(num_rows // block, N, dtype=torch.float32, device=src.device)
    block_n = 32 if interpreter_on() else 64
    if num_rows and N:
        _quantize_gathered_columns_kernel[(num_rows // block, cdiv(N, block_n))](
            src, row_to_token, data, scale_inv, N, src.stride(0), data.stride(0), scale_inv.stride(0), fmt.max,
            fmt.mantissa_bits, fmt.min_normal_exponent, power_of_2, BLOCK=block, BLOCK_N=block_n,
        )  # fmt: skip
    return data, scale_inv


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, stride_src_e, stride_src_r, stride_dst_e, stride_dst_c,
                      BLOCK: tl.constexpr):  # fmt: skip
    """Grid: (E, cdiv(R, BLOCK), cdiv(C, BLOCK)); program (e, i, j): dst[e, j-block, i-block] = src[e,
    i-block, j-block]^T, bytes (the FP8 values moved, not converted)."""
    e = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    tile = tl.load(src_ptr + e * stride_src_e + rows[:, None] * stride_src_r + cols[None, :], mask=mask)
    tl.store(dst_ptr + e * stride_dst_e + cols[:, None] * stride_dst_c + rows[None, :], tl.trans(tile),
             mask=tl.trans(mask))  # fmt: skip


def transposed_copy(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantised weight's transpose, the same FP8 values and 128 x 128 scales: (data [..., C, R],
    scale_inv [..., cdiv(C, 128), cdiv(R, 128)]) of (data [..., R, C], scale_inv [..., cdiv(R, 128),
    cdiv(C, 128)]). The backward's dgrads reduce over a weight's rows, and Hopper's FP8 MMA takes its
    operands K-major only; made here from the forward's FP8 weights where the forward did not make
    them with its own (`quantize_weights(..., with_transpose=True)`: no grad then). The values by a
    tiled kernel: torch's strided copy of one-byte elements took 3.4 ms for qwen3-30b-a3b's experts
    on the H200 (f2), about 7x their bytes' time."""
    check_tensor("data", data, data.dim())
    matrices = data.reshape(-1, *data.shape[-2:]).view(torch.uint8)
    E, R, C = matrices.shape
    out = torch.empty(E, C, R, dtype=torch.uint8, device=data.device)
    block = 32 if interpreter_on() else 64
    if matrices.numel():
        _transpose_kernel[(E, cdiv(R, block), cdiv(C, block))](
            matrices, out, R, C, matrices.stride(0), matrices.stride(1), out.stride(0), out.stride(1), BLOCK=block
        )
    values = out.view(data.dtype).reshape(*data.shape[:-2], C, R)
    return values, scale_inv.transpose(-1, -2).contiguous()
