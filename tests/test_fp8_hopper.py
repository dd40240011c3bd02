"""The blockwise-FP8 Gluon kernels for Hopper (kernels/fp8_hopper.py, issue 25): on unless
MOK_HOPPER_FP8_WGRAD=0 / MOK_HOPPER_FP8_ROWS=0 turn them off; compiled for sm_90 on the CPU, they fit
Hopper's shared memory without spilling and ptxas pipelines their wgmma;
on an sm_90 GPU, bitwise the Triton kernels (`fp8_mlp.py`) they stand in for, directly and through the
FP8 experts' forward and backward, close to a float64 sum, and bitwise repeatable."""

import functools

import pytest
import torch

pytest.importorskip("triton", reason="the FP8 kernels need triton")

from triton_cases import crafted_routing, hopper_only, outside_the_interpreter  # noqa: E402

from mok_plugin.fp8.recipe import E4M3, E5M2, FP8_FORMATS  # noqa: E402
from mok_plugin.kernels import fp8_fc1_hopper, fp8_hopper, fp8_mlp  # noqa: E402
from mok_plugin.kernels.fp8 import quantize_rows, quantize_weights  # noqa: E402
from mok_plugin.schedule import build_schedule  # noqa: E402

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SETTINGS = (fp8_hopper.WGRAD_SETTING, fp8_hopper.ROWS_SETTING)


@pytest.mark.parametrize("setting", [*SETTINGS, fp8_fc1_hopper.SPLIT_SETTING])
def test_on_unless_the_environment_says_0(monkeypatch, setting):
    monkeypatch.delenv(setting, raising=False)
    assert fp8_hopper.enabled(setting)
    monkeypatch.setenv(setting, "0")
    assert not fp8_hopper.enabled(setting)
    monkeypatch.setenv(setting, "1")
    assert fp8_hopper.enabled(setting)
    monkeypatch.setenv(setting, "yes")
    with pytest.raises(ValueError, match=f"{setting}='yes'"):
        fp8_hopper.enabled(setting)


@pytest.mark.parametrize("rows", [True, False], ids=["row_gemms", "weight_gradients"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_ring_and_output_tiles_fit_hoppers_shared_memory(out_dtype, rows):
    stages = fp8_hopper.stages_for(out_dtype, rows)
    tiles = fp8_hopper.BLOCK_M * fp8_hopper.BLOCK_N * out_dtype.itemsize  # the two warpgroups' halves
    stage = (fp8_hopper.BLOCK_M + fp8_hopper.BLOCK_N) * (fp8_hopper.BLOCK_K + (0 if rows else 4))  # + fp32 scales
    assert 4 <= stages <= 8  # deep enough to run ahead across a short tile's two K steps
    assert stages * stage + tiles <= 227 * 1024


def test_the_weight_gradients_loop_is_flat_at_few_rows_an_expert_unless_forced(monkeypatch):
    # by default the flat loop up to FLAT_MAX_ROWS rows an expert on average (R_pad / E), tile by tile past it
    monkeypatch.setattr(fp8_hopper, "FLAT_WGRAD", None)
    limit = fp8_hopper.FLAT_MAX_ROWS
    assert fp8_hopper.flat_loop(256 * 300, 256)  # deepseek-v3: ~300 rows an expert
    assert fp8_hopper.flat_loop(limit * 8, 8) and not fp8_hopper.flat_loop(limit * 8 + 128, 8)
    assert not fp8_hopper.flat_loop(2048 * 8, 8)  # mixtral-8x7b at 8,192 tokens
    for forced in (True, False):
        monkeypatch.setattr(fp8_hopper, "FLAT_WGRAD", forced)
        assert fp8_hopper.flat_loop(256 * 300, 256) is forced and fp8_hopper.flat_loop(2048 * 8, 8) is forced


def test_the_weight_gradients_take_only_scales_tma_can_bring():
    # each stage brings a [1, 128] fp32 row of both operands' scales: rows 16-byte aligned, fp32
    assert fp8_hopper.scale_rows_ok(torch.rand(4, 200))
    assert not fp8_hopper.scale_rows_ok(torch.rand(4, 202))  # 808-byte rows
    assert not fp8_hopper.scale_rows_ok(torch.rand(4, 256)[:, 1:201])  # a base 4 bytes past alignment
    assert not fp8_hopper.scale_rows_ok(torch.rand(4, 200, dtype=torch.bfloat16))
    assert not fp8_hopper.scale_rows_ok(torch.rand(800))


def test_row_gemm_operands_are_views_of_the_halves():
    rows = torch.zeros(256, 2 * 192, dtype=torch.float8_e4m3fn)
    weights = torch.zeros(3, 200, 2 * 192, dtype=torch.float8_e4m3fn)
    (a_gate, a_up), (b_gate, b_up) = fp8_hopper.row_gemm_operands(rows, weights, gated=True)
    assert a_gate.shape == a_up.shape == (256, 192) and b_gate.shape == b_up.shape == (600, 192)
    assert a_up.data_ptr() == rows.data_ptr() + 192 and b_up.data_ptr() == weights.data_ptr() + 192
    (a,), (b,) = fp8_hopper.row_gemm_operands(rows, weights, gated=False)
    assert a is rows and b.shape == (600, 384) and b.data_ptr() == weights.data_ptr()
    assert fp8_hopper.row_gemm_operands(rows, weights.transpose(1, 2), gated=False) is None  # not contiguous


# (kind, A, B, output dtype, fc2's epilogue): the hybrid recipe multiplies E5M2 gradients by E4M3
# values (dW13: dh by x; fc1's dgrad: dh by W13)
# (the weight gradients' both loops: all a program's K steps in one, or a tile's at a time; None: the row GEMMs)
COMPILED = [
    ("wgrad", "e4m3", "e4m3", "bfloat16", False, True),
    ("wgrad", "e4m3", "e4m3", "bfloat16", False, False),
    ("wgrad", "e5m2", "e4m3", "float32", False, True),
    ("wgrad", "e5m2", "e4m3", "float32", False, False),
    ("rows", "e4m3", "e4m3", "bfloat16", True, None),
    ("rows", "e5m2", "e4m3", "float16", False, None),
    ("rows", "e5m2", "e4m3", "float32", False, None),  # fc2's dgrad: dA' in fp32 for its epilogue kernel
]


def _compiled_report(compile_call: str) -> tuple[int, ...]:
    """(shared bytes, registers, stack bytes, FP8 wgmma in the PTX, the shortest run of wgmma between
    waits in the SASS, serialisation warnings in ptxas's log) of a kernel compiled for sm_90 by
    `compile_call` (an expression over mok_plugin.bench.inspect's names and torch), in its own process:
    outside the interpreter the test session turns on."""
    code = (
        "import re, subprocess, tempfile, torch\n"
        "from pathlib import Path\n"
        "import triton\n"
        "from mok_plugin.bench.inspect import compile_fp8_fc1_hopper, compile_fp8_hopper, resource_usage\n"
        f"k = {compile_call}\n"
        "bin_dir = Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin'\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    Path(d, 'k.cubin').write_bytes(k.asm['cubin'])\n"
        "    Path(d, 'k.ptx').write_text(k.asm['ptx'])\n"
        "    sass = subprocess.run([str(bin_dir / 'cuobjdump'), '-sass', str(Path(d, 'k.cubin'))],\n"
        "                          capture_output=True, text=True).stdout\n"
        "    log = subprocess.run([str(bin_dir / 'ptxas'), '-v', '--gpu-name=sm_90a', str(Path(d, 'k.ptx')), '-o',\n"
        "                          str(Path(d, 'again.cubin'))], capture_output=True, text=True).stderr\n"
        "steps = re.findall(r'(QGMMA|WARPGROUP.DEPBAR)', sass)\n"
        "runs = [len(run) for run in ''.join('q' if s == 'QGMMA' else ' ' for s in steps).split()]\n"
        "mma = len(re.findall(r'wgmma.mma_async.sync.aligned.m64n128k32.f32.e[45]m[23].e[45]m[23]', k.asm['ptx']))\n"
        "print(k.metadata.shared, *resource_usage(k.asm['cubin']), mma, min(runs), len(re.findall('C751[1-5]', log)))\n"
    )
    return tuple(map(int, outside_the_interpreter("-c", code).split()[-6:]))


@pytest.mark.parametrize("kind, a, b, out, epilogue, flat", COMPILED)
def test_compiles_for_sm90_without_a_gpu(kind, a, b, out, epilogue, flat):
    # Compiled as its launcher specialises the call: its shared memory fits Hopper's 227 KiB, nothing
    # spills, each warpgroup's K step is four FP8 wgmma k32 issued back to back (ptxas serialises a
    # kernel's wgmma, a wait after each, where it cannot pipeline them: the first version's fate), and
    # ptxas reports no serialised wgmma (C7511-C7515).
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    shared, registers, stack, mma, shortest_run, serialised = _compiled_report(
        f"compile_fp8_hopper({kind!r}, torch.{out}, torch.{FP8[a]}, torch.{FP8[b]}, bias={epilogue}, "
        f"routing={epilogue}, flat={flat})"
    )
    assert shared <= 227 * 1024
    assert stack == 0, f"{stack} bytes of stack per thread: registers spill"
    assert 0 < registers <= fp8_hopper.MAX_REGS
    # the two warpgroups' functions, each with three K steps of four k32 (fp8_hopper.pipelined_steps and
    # flat_wgrad_steps: the even and odd steps of the loop and an odd count's last step)
    assert mma == 2 * 3 * 4
    assert shortest_run == 4, "ptxas waits between a K step's wgmma: serialised"
    assert serialised == 0


# fc1's forward: (keyword arguments of compile_fp8_fc1_hopper, the stack a thread it compiles to) --
# the gated families' main loop holds two sums and a product and spills (fp8_fc1_hopper.MMA_REGS);
# the bound catches a change that makes it worse (the split form, the default, does not spill: it ran 3-4 %
# faster on the H200)
FC1_COMPILED = [
    pytest.param("", 96, id="swiglu"),
    pytest.param("bias=True, activation='quick_gelu', clamp=7.0, offset=1.0", 192, id="gpt_oss"),
    pytest.param("gated=False, activation='gelu', bias=True", 0, id="mlp_gelu_bias"),
    pytest.param("fmt='e5m2', out_dtype=torch.float16", 96, id="e5m2_A_fp16_h"),
]


@pytest.mark.parametrize("arguments, stack_bound", FC1_COMPILED)
def test_fc1_compiles_for_sm90_without_a_gpu(arguments, stack_bound):
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    shared, registers, stack, mma, shortest_run, serialised = _compiled_report(f"compile_fp8_fc1_hopper({arguments})")
    gated = "gated=False" not in arguments
    assert shared <= 227 * 1024
    assert stack <= stack_bound
    assert 0 < registers <= fp8_hopper.MAX_REGS
    assert mma == 2 * 4 * (1 + gated)  # per warpgroup and K step: the gate's four k32 steps (and the up's)
    assert shortest_run == 4 and serialised == 0


def test_not_chosen_off_hopper():
    # Asked for on a machine without an sm_90 GPU (here: CPU tensors), the Triton kernels run.
    operand = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    assert not fp8_hopper.usable((operand, operand), torch.zeros(128, 64, dtype=torch.bfloat16))


def _fp8(shape, dtype, generator, zero_columns=None):
    values = torch.randn(shape, generator=generator) * 8
    if zero_columns is not None:
        values = values.masked_fill(zero_columns, 0)
    return values.to(dtype).cuda()


def _pow2_scales(shape, generator):
    return (2.0 ** torch.randint(-6, 7, shape, generator=generator).float()).cuda()


def _with(monkeypatch, setting, value, fn):
    monkeypatch.setenv(setting, value)
    return fn()


def _counting_module(monkeypatch, module, name):
    """Record each launch of `module`'s function `name`."""
    launches = []
    launch = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: launches.append(name) or launch(*a, **k))
    return launches


def _counting(monkeypatch, name):
    """Record each launch of fp8_hopper's `name` (fp8_wgrad_hopper or fp8_rows_hopper)."""
    return _counting_module(monkeypatch, fp8_hopper, name)


# --- weight gradients ---------------------------------------------------------------------------


def _wgrad_operands(M, N, E, T, K, kind, left, right, seed=3):
    """A 128-row schedule's segments and two FP8 operands in the kernels' layout: transposed, [M or N,
    R_pad], zeros on padding rows, power-of-two 128 x 1 scales [R_pad / 128, M or N] (as the recipe's)."""
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=128)
    rows = schedule.row_to_token.shape[0]
    pad = (schedule.row_to_token < 0).cpu()
    left_t, right_t = _fp8((M, rows), FP8[left], g, pad), _fp8((N, rows), FP8[right], g, pad)
    return schedule, (left_t, _pow2_scales((rows // 128, M), g)), (right_t, _pow2_scales((rows // 128, N), g))


def _fp8_wgrad(operands, out_dtype):
    schedule, (left_t, left_s), (right_t, right_s) = operands
    return fp8_mlp.fp8_wgrad(left_t, left_s, right_t, right_s, schedule.expert_offsets, schedule.tokens_per_expert,
                             out_dtype=out_dtype)  # fmt: skip


def _float64_wgrad(operands):
    schedule, (left_t, left_s), (right_t, right_s) = operands
    blocks = torch.arange(left_t.shape[1], device=left_t.device) // 128
    left = left_t.double() * left_s.double()[blocks].T
    right = right_t.double() * right_s.double()[blocks].T
    out = []
    for start, count in zip(schedule.expert_offsets[:-1].tolist(), schedule.tokens_per_expert.tolist(), strict=True):
        out.append(left[:, start : start + count] @ right[:, start : start + count].T)
    return torch.stack(out)


WGRAD_CASES = [
    # M, N, E, T, K, routing, left, right: empty experts and one with many 128-row blocks; M and N not
    # multiples of the tiles (TMA clips the reads and, per expert, the store); the hybrid recipe's formats
    pytest.param(256, 384, 16, 512, 2, "skewed", "e4m3", "e4m3", id="skewed_empty_experts"),
    pytest.param(200, 72, 8, 700, 3, "uniform", "e4m3", "e4m3", id="M_N_not_tile_multiples"),
    pytest.param(384, 256, 4, 900, 2, "one_expert", "e5m2", "e4m3", id="hybrid_many_blocks"),
    pytest.param(128, 128, 32, 1, 4, "uniform", "e4m3", "e4m3", id="T1_mostly_empty"),
    pytest.param(192, 256, 4, 900, 2, "one_expert", "e4m3", "e4m3", id="second_half_past_M"),
]

# Persistent programs a launch: as many as tiles fit (one per SM), and few, so that each program
# walks many tiles and the ring wraps (its phases, the output buffers' reuse after a store)
PROGRAMS = [pytest.param(None, id="one_per_SM"), pytest.param(3, id="3_programs")]


@hopper_only
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "tile_by_tile"])
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, N, E, T, K, kind, left, right", WGRAD_CASES)
def test_weight_gradients_bitwise_the_triton_kernel(monkeypatch, flat, programs, out_dtype, M, N, E, T, K, kind, left,
                                                    right):  # fmt: skip
    # both loops of the MMA warpgroups: all the program's K steps in one (by default up to FLAT_MAX_ROWS rows an
    # expert), or a tile's at a time
    monkeypatch.setattr(fp8_hopper, "PROGRAMS", programs)
    monkeypatch.setattr(fp8_hopper, "FLAT_WGRAD", flat)
    operands = _wgrad_operands(M, N, E, T, K, kind, left, right)
    want = _with(monkeypatch, fp8_hopper.WGRAD_SETTING, "0", lambda: _fp8_wgrad(operands, out_dtype))
    launches = _counting(monkeypatch, "fp8_wgrad_hopper")
    got = _with(monkeypatch, fp8_hopper.WGRAD_SETTING, "1", lambda: _fp8_wgrad(operands, out_dtype))
    assert launches == ["fp8_wgrad_hopper"]
    assert torch.equal(got, want)
    assert all(torch.equal(_fp8_wgrad(operands, out_dtype), got) for _ in range(3))  # bitwise repeatable
    exact = _float64_wgrad(operands)
    error = ((got.double() - exact).norm() / exact.norm()).item()
    # bf16's rounding; in fp32 the FP8 MMA's own sums within a 128-row block (not fp32's)
    assert error < (1e-2 if out_dtype == torch.bfloat16 else 1e-3), error


# --- row GEMMs ----------------------------------------------------------------------------------


def _rows_case(H, I, E, T, K, kind, gated, a_fmt, seed=4):
    """A 128-row schedule, FP8 rows A [R_pad, halves * I] (1 x 128 scales [R_pad, halves, cdiv(I, 128)])
    and FP8 weights B [E, H, halves * I] (128 x 128 scales [E, halves, cdiv(H, 128), cdiv(I, 128)]): the
    operands of fc1's dgrad (two halves) and, with one, of fc2's forward."""
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=128)
    rows, halves, blocks = schedule.row_to_token.shape[0], 1 + gated, -(-I // 128)
    a = _fp8((rows, halves * I), FP8[a_fmt], g)
    b = _fp8((E, H, halves * I), torch.float8_e4m3fn, g)
    a_s = _pow2_scales((rows, halves, blocks), g)
    b_s = _pow2_scales((E, halves, -(-H // 128), blocks), g)
    return schedule, a, a_s, b, b_s, g


def _assert_rows_bitwise_the_triton_kernel(monkeypatch, row_gemm, sched):
    """row_gemm() through the Gluon kernel (launched once) gives the Triton kernel's rows bit for bit,
    and the same again; padding rows hold values of no meaning and are not compared."""
    valid = sched.row_to_token >= 0
    want = _with(monkeypatch, fp8_hopper.ROWS_SETTING, "0", row_gemm)[valid]
    launches = _counting(monkeypatch, "fp8_rows_hopper")
    got = _with(monkeypatch, fp8_hopper.ROWS_SETTING, "1", row_gemm)[valid]
    assert launches == ["fp8_rows_hopper"]
    assert torch.equal(got, want)
    assert all(torch.equal(row_gemm()[valid], got) for _ in range(3))


ROWS_CASES = [
    # H, I, E, T, K, routing: I a partial 128-block in each half; H past the last 128-column tile;
    # empty experts and padding tiles
    pytest.param(256, 192, 8, 600, 2, "skewed", id="partial_K_block_skewed"),
    pytest.param(200, 256, 6, 700, 3, "uniform", id="H_not_a_tile_multiple"),
    pytest.param(384, 128, 32, 1, 4, "uniform", id="T1_mostly_padding"),
    pytest.param(256, 1024, 4, 800, 2, "uniform", id="more_steps_than_stages"),
]


@hopper_only
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("H, I, E, T, K, kind", ROWS_CASES)
def test_fc2_forward_bitwise_the_triton_kernel(monkeypatch, programs, bias, H, I, E, T, K, kind):
    monkeypatch.setattr(fp8_hopper, "PROGRAMS", programs)
    sched, a, a_s, w2, w2_s, g = _rows_case(H, I, E, T, K, kind, gated=False, a_fmt="e4m3")
    weights = torch.rand(T, K, generator=g).softmax(-1).cuda()
    b2 = (torch.randn(E, H, generator=g) * 0.5).cuda().bfloat16() if bias else None

    def down():
        return fp8_mlp.fp8_down_fwd(a, a_s.squeeze(1), w2, w2_s.squeeze(1), weights, sched.row_to_tk,
                                    sched.row_to_token, sched.tile_to_expert, sched.tile_m, out_dtype=torch.bfloat16,
                                    down_bias=b2)  # fmt: skip

    _assert_rows_bitwise_the_triton_kernel(monkeypatch, down, sched)


@hopper_only
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("gated, a_fmt", [(True, "e4m3"), (True, "e5m2"), (False, "e4m3")])
@pytest.mark.parametrize("H, I, E, T, K, kind", ROWS_CASES)
def test_fc1_dgrad_bitwise_the_triton_kernel(monkeypatch, programs, gated, a_fmt, H, I, E, T, K, kind):
    monkeypatch.setattr(fp8_hopper, "PROGRAMS", programs)
    sched, dh, dh_s, w13, w13_s, _ = _rows_case(H, I, E, T, K, kind, gated=gated, a_fmt=a_fmt)

    def dgrad():
        return fp8_mlp.fp8_gate_up_dgrad(dh, dh_s, w13, w13_s, sched.row_to_token, sched.tile_to_expert, sched.tile_m,
                                         out_dtype=torch.bfloat16, gated=gated)  # fmt: skip

    _assert_rows_bitwise_the_triton_kernel(monkeypatch, dgrad, sched)


@hopper_only
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("d_out_fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("H, I, E, T, K, kind", ROWS_CASES)
def test_fc2_dgrad_bitwise_the_triton_kernel(monkeypatch, programs, d_out_fmt, H, I, E, T, K, kind):
    # The GEMM on dO's rows copied into row order (the hybrid recipe's E5M2 dO by E4M3 W2 too); every
    # output of the epilogue that reads it compared on the rows and 128-row blocks it writes.
    monkeypatch.setattr(fp8_hopper, "PROGRAMS", programs)
    g = torch.Generator().manual_seed(5)
    sched = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=128)
    d_out = torch.randn(T, H, generator=g).cuda().bfloat16()
    h = torch.randn(sched.row_to_token.shape[0], 2 * I, generator=g).cuda().bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).cuda().bfloat16()
    weights = torch.rand(T, K, generator=g).softmax(-1).cuda()
    d_out_q, d_out_s = quantize_rows(d_out, FP8_FORMATS[d_out_fmt])
    _, (w2t_q, w2t_s) = quantize_weights(w2, E4M3, with_transpose=True)

    def dgrad():
        return fp8_mlp.fp8_down_dgrad(d_out_q, d_out_s, w2t_q, w2t_s, h, weights, sched.row_to_tk, sched.row_to_token,
                                      sched.tile_to_expert, sched.tile_m, E4M3, FP8_FORMATS[d_out_fmt])  # fmt: skip

    valid = sched.row_to_token >= 0
    blocks = sched.tile_to_expert >= 0  # (tile_m = 128: a tile is one scale block)
    written = {"dh_q": valid, "dh_scale_inv": valid, "partial": valid, "dh_colt": (slice(None), valid),
               "wa_colt": (slice(None), valid), "dh_col_scale_inv": blocks, "wa_col_scale_inv": blocks}  # fmt: skip
    want = _with(monkeypatch, fp8_hopper.ROWS_SETTING, "0", dgrad)
    launches = _counting(monkeypatch, "fp8_rows_hopper")
    got = _with(monkeypatch, fp8_hopper.ROWS_SETTING, "1", dgrad)
    assert launches == ([] if H % 16 else ["fp8_rows_hopper"])  # TMA reads dO's H-byte rows 16-byte aligned
    assert sorted(got) == sorted(written)
    for name, rows in written.items():
        assert torch.equal(_bits(got[name][rows]), _bits(want[name][rows])), name
    again = dgrad()
    assert all(torch.equal(_bits(again[name][rows]), _bits(got[name][rows])) for name, rows in written.items())


def _fc1_case(family, I, H, E, T, K, kind, dtype, a_format, seed=7):
    """(schedule, fp8_gate_up_fwd over quantised random inputs of these sizes) for one family."""
    from mok_plugin.kernels.fp8 import quantize_fc1, quantize_rows

    g = torch.Generator().manual_seed(seed)
    routing = crafted_routing(max(T, 1), E, K, kind, g)[:T]
    sched = build_schedule(routing.cuda(), E, tile_m=128)
    x = torch.randn(T, H, generator=g).cuda().to(dtype)
    w13 = (torch.randn(E, family.fc1_width(I), H, generator=g) / H**0.5).cuda().to(dtype)
    b1 = (torch.randn(E, family.fc1_width(I), generator=g) * 0.1).cuda().to(dtype) if family.fc1_bias else None
    x_q, x_s = quantize_rows(x, E4M3)
    w13_q, w13_s = quantize_fc1(w13, E4M3, gated=family.gated)

    def fc1():
        return fp8_mlp.fp8_gate_up_fwd(
            x_q, x_s, w13_q, w13_s, sched.row_to_token, sched.tile_to_expert, sched.tile_m, a_format,
            out_dtype=dtype, gate_up_bias=b1, activation=family.activation, gated=family.gated, clamp=family.clamp,
            offset=family.linear_offset,
        )  # fmt: skip

    return sched, fc1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in FP8.values() else t


@hopper_only
@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize(
    "family_name, I, dtype, a_fmt",
    [("swiglu", 256, "bfloat16", "e4m3"), ("swiglu", 192, "float16", "e5m2"), ("gpt_oss", 384, "bfloat16", "e4m3"),
     ("mlp_gelu_bias", 128, "bfloat16", "e4m3"), ("mlp_gelu_bias", 192, "bfloat16", "e4m3")],
)  # fmt: skip
@pytest.mark.parametrize("H, E, T, K, kind", [(512, 8, 600, 2, "skewed"), (1024, 4, 900, 2, "uniform"),
                                              (320, 6, 500, 3, "uniform")])  # fmt: skip
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_fc1_forward_bitwise_the_triton_kernel(monkeypatch, programs, family_name, I, dtype, a_fmt, H, E, T, K, kind,
                                               split):  # fmt: skip
    # x's rows copied into row order and fc1 on the Gluon kernel: h, A_q and A's scales bit for bit the
    # Triton kernel's on the real rows, and the same again (H = 1024: more K steps than stages; 320: a
    # partial last K block, as gpt-oss-120b's 2880; I = 192: a partial last I block). split
    # (MOK_HOPPER_FP8_FC1_SPLIT): h by the row GEMM over N1 and A apart where I is a multiple of 128,
    # else the fused kernel all the same
    from mok_plugin.testing import EXPERT_FAMILIES

    monkeypatch.setattr(fp8_hopper, "PROGRAMS", programs)
    monkeypatch.setenv(fp8_fc1_hopper.SPLIT_SETTING, str(int(split)))
    a_format = {"e4m3": E4M3, "e5m2": E5M2}[a_fmt]
    sched, fc1 = _fc1_case(EXPERT_FAMILIES[family_name], I, H, E, T, K, kind, getattr(torch, dtype), a_format)
    valid = sched.row_to_token >= 0
    want = [_bits(t[valid]) for t in _with(monkeypatch, fp8_hopper.ROWS_SETTING, "0", fc1)]
    fused = _counting_module(monkeypatch, fp8_fc1_hopper, "fp8_fc1_hopper")
    rows = _counting(monkeypatch, "fp8_rows_hopper")
    got = [_bits(t[valid]) for t in _with(monkeypatch, fp8_hopper.ROWS_SETTING, "1", fc1)]
    taken = ([], ["fp8_rows_hopper"]) if split and I % 128 == 0 else (["fp8_fc1_hopper"], [])
    assert (fused, rows) == taken
    for name, got_t, want_t in zip(("h", "a_q", "a_scale_inv"), got, want, strict=True):
        assert torch.equal(got_t, want_t), name
    assert all(torch.equal(_bits(t[valid]), g_t) for t, g_t in zip(fc1(), got, strict=True))


@hopper_only
def test_fc1_forward_with_no_tokens_keeps_the_triton_kernel(monkeypatch):
    # An expert-parallel rank that receives no tokens: every tile is padding, and the copy of x's rows
    # would have no token to stand in for them; the Triton kernel (which does nothing) runs.
    from mok_plugin.testing import EXPERT_FAMILIES

    sched, fc1 = _fc1_case(EXPERT_FAMILIES["swiglu"], 256, 512, 8, 0, 2, "uniform", torch.bfloat16, E4M3)
    fused = _counting_module(monkeypatch, fp8_fc1_hopper, "fp8_fc1_hopper")
    rows = _counting(monkeypatch, "fp8_rows_hopper")  # (I = 256: the split form where it runs)
    h, a_q, a_scale = _with(monkeypatch, fp8_hopper.ROWS_SETTING, "1", fc1)
    torch.cuda.synchronize()
    assert fused == [] and rows == [] and h.shape[0] == sched.row_to_token.shape[0]


# --- through the FP8 experts ------------------------------------------------------------------------


@hopper_only
@pytest.mark.parametrize("family_name, I", [("swiglu", 384), ("gpt_oss", 192), ("mlp_gelu_bias", 256), ("swiglu", 200)])
def test_the_fp8_experts_give_the_same_results(monkeypatch, family_name, I):
    # Forward and backward (hybrid recipe) with the Gluon kernels on (the defaults) against the Triton
    # ones: the same output and gradients, bit for bit. fc1's forward split where I is a multiple of 128
    # (384, 256), by its fused kernel at 192; I = 200: not a multiple of 16, so the I-wide rows cannot be
    # TMA views and those GEMMs stay in Triton (still the same results).
    from mok_plugin.fp8.pipeline import fp8_experts_backward, fp8_experts_forward
    from mok_plugin.fp8.recipe import BlockwiseFP8Recipe
    from mok_plugin.testing import EXPERT_FAMILIES

    g = torch.Generator().manual_seed(11)
    T, H, E, K = 600, 512, 8, 2
    family = EXPERT_FAMILIES[family_name]
    ids = crafted_routing(T, E, K, "skewed", g)
    x = torch.randn(T, H, generator=g).cuda().bfloat16()
    weights = torch.rand(T, K, generator=g).softmax(-1).cuda()
    w13 = (torch.randn(E, family.fc1_width(I), H, generator=g) / H**0.5).cuda().bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).cuda().bfloat16()
    b1 = (torch.randn(E, family.fc1_width(I), generator=g) * 0.1).cuda().bfloat16() if family.fc1_bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).cuda().bfloat16() if family.fc2_bias else None
    d_out = torch.randn(T, H, generator=g).cuda().bfloat16()
    results = {}
    wgrad_launches = _counting(monkeypatch, "fp8_wgrad_hopper")
    rows_launches = _counting(monkeypatch, "fp8_rows_hopper")
    fc1_launches = _counting_module(monkeypatch, fp8_fc1_hopper, "fp8_fc1_hopper")
    monkeypatch.delenv(fp8_fc1_hopper.SPLIT_SETTING, raising=False)
    for setting in ("0", "1"):
        for name in SETTINGS:
            monkeypatch.setenv(name, setting)
        saved: dict = {}
        run = functools.partial(fp8_experts_forward, saved=saved, family=family, gate_up_bias=b1, down_bias=b2)
        out = run(x, weights, w13, w2, build_schedule(ids.cuda(), E), BlockwiseFP8Recipe(E4M3, E5M2))
        results[setting] = {"out": out, **fp8_experts_backward(d_out, saved)}
    for name, want in results["0"].items():
        if want is not None:
            assert torch.equal(results["1"][name], want), name
    assert len(wgrad_launches) == 2  # dW13 and dW2, in the second run only
    # fc2's dgrad (its rows H wide: TMA reads them at any I); where TMA can read the I-wide rows, fc2's
    # forward, fc1's dgrad and fc1's forward, split (the row kernel) or fused (fp8_fc1_hopper)
    split = I % 128 == 0
    assert len(rows_launches) == (1 if I % 16 else 3 + split)
    assert len(fc1_launches) == (0 if I % 16 or split else 1)
