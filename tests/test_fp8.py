"""Blockwise FP8 (issue 25), the definition: the recipes Megatron's flags select, the PyTorch quantisers
that define the numbers, and the Triton helpers the fused kernels will quantise with, which must give
those numbers bit for bit (interpreted on the CPU, compiled on a GPU)."""

import pytest
import torch
import triton
import triton.language as tl
from triton_cases import outside_the_interpreter

from mok_plugin.fp8.quantize import (
    block_scales,
    dequantize_1d,
    dequantize_2d,
    fp8_round,
    quantize_1d,
    quantize_2d,
)
from mok_plugin.fp8.recipe import (
    E4M3,
    E5M2,
    BlockwiseFP8Recipe,
    MXFP8Recipe,
    TensorwiseFP8Recipe,
    fp8_recipe_from_megatron,
)
from mok_plugin.kernels.fp8 import (
    block_scale,
    quantize_fc1,
    quantize_gathered_columns,
    quantize_rows,
    quantize_weights,
    round_to_fp8_grid,
    scale_inverse,
    transposed_copy,
)
from mok_plugin.schedule import build_schedule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)


def test_megatron_flags_select_a_recipe_or_are_refused_by_name():
    assert BlockwiseFP8Recipe.from_megatron("e4m3", "blockwise") == BlockwiseFP8Recipe(E4M3, E4M3)
    hybrid = BlockwiseFP8Recipe.from_megatron("hybrid", "blockwise")
    assert (hybrid.forward, hybrid.backward, hybrid.block, hybrid.power_of_2_scales) == (E4M3, E5M2, 128, True)
    # tensorwise and mxfp8 (tests/test_fp8_recipes.py has their numbers), whichever class is asked
    assert BlockwiseFP8Recipe.from_megatron("hybrid", "tensorwise") == TensorwiseFP8Recipe(E4M3, E5M2, False)
    assert fp8_recipe_from_megatron("e4m3", "mxfp8") == MXFP8Recipe(E4M3, E4M3)
    for recipe, why in (("delayed", "amax history"), ("custom", "quantiser factory")):
        with pytest.raises(ValueError, match=f"--fp8-recipe {recipe}: .*{why}"):
            BlockwiseFP8Recipe.from_megatron("e4m3", recipe)
    with pytest.raises(ValueError, match="--fp8-recipe 'blockwize': unknown"):
        BlockwiseFP8Recipe.from_megatron("e4m3", "blockwize")
    with pytest.raises(ValueError, match="--fp8-format 'e5m2': MoK's FP8 recipes take e4m3 or hybrid"):
        fp8_recipe_from_megatron("e5m2", "mxfp8")
    with pytest.raises(ValueError, match="power of two"):
        BlockwiseFP8Recipe(block=96)


def test_every_megatron_fp8_recipe_has_an_answer():
    # Megatron's own list of --fp8-recipe values against the recipe table (a new value must be decided)
    enums = pytest.importorskip("megatron.core.enums", reason="megatron-core is not installed")
    from mok_plugin.fp8.recipe import _MEGATRON_RECIPES

    assert {recipe.value for recipe in enums.Fp8Recipe} == set(_MEGATRON_RECIPES)


@FORMATS
def test_formats_describe_torch_dtypes(fmt):
    info = torch.finfo(fmt.dtype)
    assert info.max == fmt.max and info.smallest_normal == 2.0**fmt.min_normal_exponent
    assert torch.tensor(fmt.subnormal_step).to(fmt.dtype).float() == fmt.subnormal_step
    assert torch.tensor(fmt.subnormal_step / 2).to(fmt.dtype).float() == 0  # a tie below it: to even, 0


@FORMATS
def test_block_scales_are_powers_of_two_that_never_saturate(fmt):
    g = torch.Generator().manual_seed(1)
    amax = torch.rand(1000, generator=g) * torch.exp2(torch.randint(-30, 30, (1000,), generator=g).float())
    scale = block_scales(amax, fmt)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # a power of two
    assert (amax * scale <= fmt.max).all() and (amax * scale > fmt.max / 2).all()  # top binade, no overflow
    exact = block_scales(amax, fmt, power_of_2=False)
    assert torch.allclose(amax * exact, torch.full_like(amax, fmt.max), rtol=1e-6)
    # an all-zero block takes scale 1; one so small that max / amax overflows the largest finite scale
    assert block_scales(torch.tensor([0.0]), fmt).item() == 1.0
    assert block_scales(torch.tensor([1e-45]), fmt).item() == 2.0**127


@FORMATS
@pytest.mark.parametrize("dim", [-1, 0])
def test_quantize_1d_blocks_along_a_dimension_within_half_a_grid_step(fmt, dim):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 200, generator=g) * torch.exp2(torch.randint(-8, 8, (300, 1), generator=g).float())
    data, scale_inv = quantize_1d(x, fmt, block=128, dim=dim)
    assert data.dtype == fmt.dtype and data.shape == x.shape
    assert scale_inv.shape == ((300, 2) if dim == -1 else (3, 200))  # 200 -> 2 blocks, 300 -> 3 (a partial one)
    back = dequantize_1d(data, scale_inv, block=128, dim=dim)
    # the error of each value is at most half a grid step of its block: relative 2^-(m+1) of the
    # value's binade, and no more than half the subnormal step scaled back
    step = torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - fmt.mantissa_bits)
    blocks = scale_inv.repeat_interleave(128, dim=dim).narrow(dim, 0, x.shape[dim])
    bound = torch.maximum(step, fmt.subnormal_step * blocks) / 2
    assert ((back - x).abs() <= bound).all()
    # each block's largest value lands in the format's top binade once scaled
    moved = data.float().abs().movedim(dim, -1)
    block_max = torch.nn.functional.pad(moved, (0, -moved.shape[-1] % 128)).unflatten(-1, (-1, 128)).amax(-1)
    assert (block_max >= fmt.max / 2).all() and (block_max <= fmt.max).all()


@FORMATS
def test_quantize_2d_blocks_tiles_of_a_batch_of_weights(fmt):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 200, 130, generator=g)
    w[1, :128, :128] = 0  # an all-zero tile: scale 1, zeros back
    w[2, 128:, 128:] *= 1e4  # one loud tile does not change its neighbours' scales
    data, scale_inv = quantize_2d(w, fmt, block=128)
    assert data.shape == w.shape and scale_inv.shape == (3, 2, 2)
    assert scale_inv[1, 0, 0] == 1.0 and (data[1, :128, :128].float() == 0).all()
    assert scale_inv[2, 1, 1] > scale_inv[2, 0, 0] * 1000
    back = dequantize_2d(data, scale_inv, block=128)
    plain = w[0].abs() > 1e-2  # normal values once scaled: within half a step, 2^-(m+1) relative
    assert ((back[0] - w[0]).abs() / w[0].abs())[plain].max() <= 2.0 ** -(fmt.mantissa_bits + 1)
    # a tile's values and the same tile quantised alone agree (tiles are independent)
    alone, alone_inv = quantize_2d(w[0, 128:, :128], fmt)
    assert torch.equal(alone.float(), data[0, 128:, :128].float()) and alone_inv.item() == scale_inv[0, 1, 0]


@FORMATS
def test_values_on_the_grid_of_a_power_of_2_scale_come_back_exactly(fmt):
    grid = _positive_grid(fmt)
    x = torch.cat([grid, -grid]) * 2.0**-5  # any power-of-2 multiple of grid values, largest at max / 32
    data, scale_inv = quantize_1d(x[None, :], fmt, block=x.numel())
    assert scale_inv.item() == 2.0**-5
    assert torch.equal(dequantize_1d(data, scale_inv, block=x.numel())[0], x)


@triton.jit
def _round_and_scale_kernel(
    v_ptr,
    rounded_ptr,
    scale_ptr,
    inverse_ptr,
    MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXPONENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    BLOCK: tl.constexpr,
    FROM_BITS: tl.constexpr = True,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs)
    tl.store(rounded_ptr + offs, round_to_fp8_grid(v, MAX, MANTISSA_BITS, MIN_NORMAL_EXPONENT))
    scale = block_scale(tl.abs(v), MAX, POWER_OF_2, FROM_BITS)
    tl.store(scale_ptr + offs, scale)
    tl.store(inverse_ptr + offs, scale_inverse(scale, POWER_OF_2, FROM_BITS))


def _positive_grid(fmt) -> torch.Tensor:
    """Every finite positive value of the format, ascending, fp32."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    return values[torch.isfinite(values) & (values > 0)].unique()


@FORMATS
@pytest.mark.parametrize("power_of_2", [True, False], ids=["pow2", "fp32_scales"])
def test_triton_rounding_and_scales_are_the_quantisers_bit_for_bit(fmt, power_of_2):
    # Every grid value, every midpoint between neighbours (ties: to even) and the fp32 values either
    # side of each midpoint, the values just under each power of two (a carry into the exponent:
    # the interpreter's own cast gets these wrong), subnormals, zeros, random values, and values past
    # max up to inf (clamped to max: the GPU's conversion saturates).
    grid = _positive_grid(fmt)
    mid = (grid[1:] + grid[:-1]) / 2
    eps = torch.finfo(torch.float32).eps
    powers = torch.exp2(torch.arange(fmt.min_normal_exponent, 16, dtype=torch.float32))
    g = torch.Generator().manual_seed(4)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 16, (4096,), generator=g).float())
    step = fmt.subnormal_step
    special = torch.tensor([0.0, fmt.max, step / 2, step / 4, step * 0.75, 1e-30])  # negated below: -0.0 too
    values = torch.cat([grid, mid, mid * (1 + eps), mid * (1 - eps), powers * (1 - eps), special, rand])
    values = torch.cat([values, -values]).clamp(-fmt.max, fmt.max)
    beyond = torch.tensor([fmt.max * (1 + eps), fmt.max * 1.5, fmt.max * 4, 1e30, float("inf")])  # saturate at max
    values = torch.cat([values, beyond, -beyond])
    values = torch.nn.functional.pad(values, (0, -values.numel() % 1024), value=1.0).to(DEVICE)
    rounded, scale, inverse = torch.empty_like(values), torch.empty_like(values), torch.empty_like(values)
    _round_and_scale_kernel[(values.numel() // 1024,)](
        values, rounded, scale, inverse, fmt.max, fmt.mantissa_bits, fmt.min_normal_exponent, power_of_2, BLOCK=1024
    )
    want = fp8_round(values.cpu(), fmt)
    # bit patterns, not values: -0.0 (a tiny negative value rounded to zero) must stay -0.0
    differ = rounded.cpu().view(torch.int32) != want.view(torch.int32)
    assert not differ.any(), f"{differ.sum()} values rounded differently, e.g. {values.cpu()[differ][:4].tolist()}"
    assert torch.equal(rounded.cpu().to(fmt.dtype).float(), want)  # on the grid: the cast changes nothing
    assert torch.equal(scale.cpu(), block_scales(values.cpu().abs(), fmt, power_of_2))


@FORMATS
@pytest.mark.parametrize(
    "power_of_2, from_bits", [(True, True), (True, False), (False, True)], ids=["pow2", "pow2_divided", "fp32_scales"]
)
def test_block_scales_of_every_binade_are_the_quantisers(fmt, power_of_2, from_bits):
    # The power-of-two scale comes from exponent and mantissa bits, not a division (or by division,
    # FROM_BITS=False, as fc1's Gluon kernel asks): every fp32 binade (subnormals, those whose quotient
    # overflows, FLT_MAX's), the mantissas either side of MAX's (where the quotient drops a binade),
    # and zero, inf and NaN, against block_scales' IEEE division; and their inverses (scale_inv)
    max_mantissa = torch.tensor([fmt.max], dtype=torch.float32).view(torch.int32).item() & 0x7FFFFF
    mantissas = torch.tensor([0, 1, max_mantissa - 1, max_mantissa, max_mantissa + 1, 0x7FFFFF], dtype=torch.int32)
    exponents = torch.arange(0, 255, dtype=torch.int32)
    bits = ((exponents[:, None] << 23) | mantissas[None, :]).flatten()
    specials = torch.tensor([0.0, float("inf"), float("nan")]).view(torch.int32)
    amax = torch.cat([bits, specials]).view(torch.float32)
    amax = torch.nn.functional.pad(amax, (0, -amax.numel() % 1024), value=1.0).to(DEVICE)
    rounded, scale, inverse = torch.empty_like(amax), torch.empty_like(amax), torch.empty_like(amax)
    _round_and_scale_kernel[(amax.numel() // 1024,)](
        amax,
        rounded,
        scale,
        inverse,
        fmt.max,
        fmt.mantissa_bits,
        fmt.min_normal_exponent,
        power_of_2,
        BLOCK=1024,
        FROM_BITS=from_bits,
    )
    want = block_scales(amax.cpu(), fmt, power_of_2)
    differ = scale.cpu().view(torch.int32) != want.view(torch.int32)
    assert not differ.any(), f"{differ.sum()} scales differ, e.g. amax {amax.cpu()[differ][:4].tolist()}"
    differ = inverse.cpu().view(torch.int32) != (1 / want).view(torch.int32)  # scale_inv: IEEE 1 / scale
    assert not differ.any(), f"{differ.sum()} inverses differ, e.g. scale {want[differ][:4].tolist()}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@FORMATS
@pytest.mark.parametrize("power_of_2", [True, False], ids=["pow2", "fp32_scales"])
def test_quantisation_kernels_are_the_quantisers_bit_for_bit(fmt, power_of_2):
    # Rows (x, dO: 1 x 128 along H) and weights (128 x 128 tiles per expert), with partial blocks at
    # both edges, an all-zero block, a loud one, and a matrix given without the experts' dimension.
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(45, 300, generator=g) * torch.exp2(torch.randint(-6, 6, (45, 1), generator=g).float())
    rows[3, 128:256] = 0
    rows[7, :128] *= 1e4
    weights = torch.randn(3, 200, 260, generator=g) / 16
    weights[1, 128:, :128] = 0
    for dtype in (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16,):
        x, w = rows.to(DEVICE, dtype), weights.to(DEVICE, dtype)
        data, scale_inv = quantize_rows(x, fmt, power_of_2=power_of_2)
        want, want_inv = quantize_1d(x.cpu(), fmt, power_of_2=power_of_2)
        assert _same_bits(data, want) and torch.equal(scale_inv.cpu(), want_inv)
        data, scale_inv = quantize_weights(w, fmt, power_of_2=power_of_2)
        want, want_inv = quantize_2d(w.cpu(), fmt, power_of_2=power_of_2)
        assert _same_bits(data, want) and torch.equal(scale_inv.cpu(), want_inv)
        data, scale_inv = quantize_weights(w[2], fmt, power_of_2=power_of_2)
        assert _same_bits(data, want[2]) and torch.equal(scale_inv.cpu(), want_inv[2])
    empty, empty_inv = quantize_rows(rows[:0].to(DEVICE), fmt)
    assert empty.shape == (0, 300) and empty_inv.shape == (0, 3)


@FORMATS
def test_gathered_rows_quantised_along_the_rows_per_expert_block_and_stored_transposed(fmt):
    # The weight gradients' by-token operands: src[row_to_token[r]] in schedule order (zeros on
    # padding rows), 128 x 1 blocks that start at each expert's first row, stored [N, R_pad].
    g = torch.Generator().manual_seed(7)
    T, N, E = 150, 72, 3
    src = (torch.randn(T, N, generator=g) * torch.exp2(torch.randint(-4, 4, (T, 1), generator=g).float())).half()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    schedule = build_schedule(ids.to(DEVICE), E)
    data_t, scale_inv = quantize_gathered_columns(src.to(DEVICE), schedule.row_to_token, fmt)
    rows = schedule.row_to_token.cpu()
    gathered = torch.where((rows >= 0)[:, None], src[rows.clamp(min=0)].float(), 0.0)
    want, want_inv = quantize_1d(gathered, fmt, block=128, dim=0)
    assert data_t.shape == (N, rows.numel()) and _same_bits(data_t.t(), want)
    assert torch.equal(scale_inv.cpu(), want_inv)
    # a weight's transposed copy: the same FP8 values and tile scales, transposed
    data, inv = quantize_weights(src[:130].reshape(1, 130, N).to(DEVICE), fmt)
    data_tt, inv_t = transposed_copy(data, inv)
    assert _same_bits(data_tt.transpose(-1, -2), data) and torch.equal(inv_t.transpose(-1, -2), inv)


def _same_copy(got: tuple, want: tuple) -> bool:
    return _same_bits(got[0], want[0]) and got[0].shape == want[0].shape and torch.equal(got[1], want[1])


@FORMATS
def test_weights_quantised_with_their_transposes_in_one_pass(fmt):
    # with_transpose: the copy and its transposed_copy, as the two passes give them, for experts'
    # matrices and one matrix, and for fc1's halves (side by side in the transpose), with partial
    # 128-blocks at both edges (I = 200, H = 72 and 300)
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(3, 200, 300, generator=g) / 16).half().to(DEVICE)
    for weights in (w, w[1]):
        copy, transposed = quantize_weights(weights, fmt, with_transpose=True)
        assert _same_copy(copy, quantize_weights(weights, fmt)) and _same_copy(transposed, transposed_copy(*copy))
    for gated, n1 in ((True, 400), (False, 200)):
        w13 = (torch.randn(2, n1, 72, generator=g) / 8).half().to(DEVICE)
        copy, transposed = quantize_fc1(w13, fmt, gated, with_transpose=True)
        assert _same_copy(copy, quantize_fc1(w13, fmt, gated))
        assert _same_copy(transposed, transposed_copy(*copy)) and transposed[0].shape == (2, 72, n1)


def test_weight_quantiser_compiles_for_sm90_without_spills_and_rounds_by_conversion():
    # The weights' quantiser holds its 128 x 128 tile in 16 warps: in 4 warps the whole tile took 255
    # registers and 400 bytes of stack with the transposed store (167 without).
    # In its own process: outside the interpreter the test session turns on.
    code = (
        "from mok_plugin.bench.inspect import compile_weight_quantiser, resource_usage\n"
        "for with_transpose in (False, True):\n"
        "    k = compile_weight_quantiser(with_transpose)\n"
        "    ptx = k.asm['ptx']\n"
        "    print(*resource_usage(k.asm['cubin']), ptx.count('ld.global.v4'), ptx.count('ld.global.b16'),\n"
        "          ptx.count('cvt.rn.satfinite.e4m3x2.f32'), ptx.count('cvt.rn.f16x2.e4m3x2'),\n"
        "          ptx.count('cvt.rz.f16.f32'))\n"
    )
    for line in outside_the_interpreter("-c", code).splitlines()[-2:]:
        registers, stack, vector_loads, two_byte_loads, to_fp8, back_from_fp8, through_f16 = map(int, line.split())
        assert registers <= 64 and stack == 0 and vector_loads > 0 and two_byte_loads == 0, line
        # rounded by the GPU's one-step conversion from f32 (fp8_of), not by hand, nor twice through f16 as
        # on sm_89, and stored as converted: not read back to fp32 and converted again
        assert to_fp8 > 0 and back_from_fp8 == 0 and through_f16 == 0, line
