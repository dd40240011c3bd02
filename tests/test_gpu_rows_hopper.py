"""The forward's row GEMMs in Gluon for Hopper (kernels/rows_hopper.py): on an sm_90 GPU, fc2's
forward and fc1's (its GEMM, then `grouped_mlp.up_activation`) bitwise the Triton kernels' rows,
close to a float64 product, bitwise repeatable; never chosen off Hopper, with a bias, or for other
schedule tiles; compiled for sm_90 without a GPU. `up_activation` against the fused Triton fc1 on
every gated and plain family also runs on the CPU (Triton's interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import DEVICE, DTYPES, crafted_routing  # noqa: E402

from mok_plugin.kernels import grouped_mlp, rows_hopper  # noqa: E402
from mok_plugin.kernels.configs import kernel_config  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402
from mok_plugin.testing import EXPERT_FAMILIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not on_hopper, reason="needs an sm_90 (Hopper) GPU")
with_gluon = rows_hopper.gluon is not None


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The Gluon kernels as a default environment has them (the variables turn them off)."""
    monkeypatch.delenv("MOK_HOPPER_ROWS", raising=False)
    if on_hopper and not with_gluon:
        pytest.skip("Triton without Gluon: the Triton kernels run")


SHAPES = [
    pytest.param((512, 384, 256, 16, 2, "skewed"), id="skewed_empty_experts"),
    pytest.param((2048, 1024, 768, 64, 8, "uniform"), id="qwen3_like"),
    pytest.param((700, 1000, 200, 24, 3, "uniform"), id="H_I_not_tile_multiples"),
    pytest.param((1, 512, 384, 32, 4, "uniform"), id="T1"),
    # one K step a tile (I = 64 for fc2, H = 64 for fc1): the loader runs whole tiles ahead and the
    # stores come back to back, where a wrong barrier phase or store wait would show
    pytest.param((4096, 64, 64, 8, 2, "skewed"), id="one_K_step_many_tiles"),
]
REPEATS = 5  # a race shows only now and then: each result is compared again this many times


def _inputs(T, H, I, E, K, kind, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=DEFAULT_TILE_M)
    a = torch.randn(schedule.num_rows, I, generator=g).cuda().to(dtype)
    down_proj = (torch.randn(E, H, I, generator=g) / I**0.5).cuda().to(dtype)
    topk_weights = torch.rand(T, K, generator=g).cuda()
    return schedule, a, down_proj, topk_weights


def _down_fwd(schedule, a, down_proj, topk_weights, config=None):
    return grouped_mlp.down_fwd(
        a, down_proj, topk_weights, schedule.row_to_tk, schedule.row_to_token, schedule.tile_to_expert,
        schedule.tile_m, config,
    )  # fmt: skip


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_hopper_down_fwd_is_bitwise_the_triton_kernel(shape, dtype, monkeypatch):
    calls = []
    launch = rows_hopper.down_fwd_hopper
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROWS_MIN_ROWS", 0)
    monkeypatch.setattr(rows_hopper, "down_fwd_hopper", lambda *a: calls.append(1) or launch(*a))
    schedule, a, down_proj, topk_weights = _inputs(*shape, dtype)
    assert rows_hopper.usable(a, down_proj, schedule.tile_m, None)
    real = schedule.row_to_token >= 0  # padding rows: the Triton kernel leaves them unset
    gluon = _down_fwd(schedule, a, down_proj, topk_weights)[real]
    for _ in range(REPEATS):
        assert torch.equal(_down_fwd(schedule, a, down_proj, topk_weights)[real], gluon), "not bitwise repeatable"
    assert len(calls) == 1 + REPEATS, "the Gluon kernel did not run"
    triton_rows = _down_fwd(schedule, a, down_proj, topk_weights, kernel_config("down_fwd", down_proj.shape[1]))
    assert len(calls) == 1 + REPEATS
    assert torch.equal(gluon, triton_rows[real]), "differs from the Triton kernel"
    expected = torch.zeros(schedule.num_rows, down_proj.shape[1], dtype=torch.float64, device=a.device)
    offsets = schedule.expert_offsets.tolist()
    for e in range(down_proj.shape[0]):
        expected[offsets[e] : offsets[e + 1]] = a[offsets[e] : offsets[e + 1]].double() @ down_proj[e].double().T
    weights = topk_weights.reshape(-1)[schedule.row_to_tk[real]].double()
    expected = expected[real] * weights[:, None]
    scale = expected.abs().max().item()
    assert scale > 0
    err = (gluon.double() - expected).abs().max().item()
    assert err <= 2**-7 * scale, f"max abs err {err:.3e} against a float64 product (scale {scale:.3e})"


def _family_args(family) -> dict:
    return {"activation": family.activation, "gated": family.kind == "glu", "clamp": family.clamp,
            "offset": family.linear_offset}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", [f for f in EXPERT_FAMILIES if EXPERT_FAMILIES[f].kind != "linear"])
def test_up_activation_is_bitwise_the_fused_fc1(family, dtype):
    # What the Gluon fc1 path runs after its GEMM: A from the stored h, the same function of the
    # same rounded values as the fused Triton kernel; on the rows in use, bitwise.
    T, H, I, E, K = 70, 48, 40, 5, 2
    g = torch.Generator().manual_seed(11)
    args = _family_args(EXPERT_FAMILIES[family])
    n1 = 2 * I if args["gated"] else I
    schedule = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, n1, H, generator=g) / H**0.5).to(DEVICE, dtype)
    h, a = grouped_mlp.gate_up_fwd(x, w13, schedule.row_to_token, schedule.tile_to_expert, schedule.tile_m, **args)
    a_after = grouped_mlp.up_activation(h, schedule.row_to_token, schedule.tile_to_expert, schedule.tile_m, **args)
    real = schedule.row_to_token >= 0
    assert a[real].abs().max() > 0
    assert torch.equal(a_after[real], a[real])


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_hopper_gate_up_fwd_is_bitwise_the_triton_kernel(shape, dtype, monkeypatch):
    T, H, I, E, K, kind = shape
    I = max(128, I // 128 * 128)  # the Gluon fc1 takes I in multiples of its 128-column tile
    calls = []
    launch = rows_hopper.gate_up_fwd_hopper
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROWS_MIN_ROWS", 0)
    monkeypatch.setattr(rows_hopper, "gate_up_fwd_hopper", lambda *a: calls.append(1) or launch(*a))
    g = torch.Generator().manual_seed(4)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=DEFAULT_TILE_M)
    x = torch.randn(T, H, generator=g).cuda().to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).cuda().to(dtype)
    assert rows_hopper.gate_up_usable(x, w13, schedule.tile_m, True, False)
    real = schedule.row_to_token >= 0

    def fc1(config=None):
        h, a = grouped_mlp.gate_up_fwd(x, w13, schedule.row_to_token, schedule.tile_to_expert, schedule.tile_m, config)
        return h[real], a[real]

    h, a = fc1()
    for _ in range(REPEATS):
        h_again, a_again = fc1()
        assert torch.equal(h, h_again) and torch.equal(a, a_again), "not bitwise repeatable"
    assert len(calls) == 1 + REPEATS, "the Gluon kernel did not run"
    h_triton, a_triton = fc1(kernel_config("gate_up_fwd", I))
    assert len(calls) == 1 + REPEATS
    assert torch.equal(h, h_triton), "h differs from the Triton kernel"
    assert torch.equal(a, a_triton), "A differs from the Triton kernel"
    expected = torch.zeros(schedule.num_rows, 2 * I, dtype=torch.float64, device=x.device)
    offsets = schedule.expert_offsets.tolist()
    tokens = schedule.row_to_token.clamp(min=0)
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        expected[rows] = x[tokens[rows]].double() @ w13[e].double().T
    expected = expected[real]
    err = (h.double() - expected).abs().max().item()
    assert err <= 2**-7 * expected.abs().max().item(), f"max abs err {err:.3e} against a float64 product"


def test_hopper_row_gemms_are_not_chosen_off_hopper_or_with_a_bias(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.zeros(256, 128, dtype=torch.bfloat16, device=device)
    w = torch.zeros(2, 256, 128, dtype=torch.bfloat16, device=device)
    assert rows_hopper.usable(a, w, DEFAULT_TILE_M, None) == (on_hopper and with_gluon)
    shifted = torch.zeros(256 * 128 + 1, dtype=a.dtype, device=device)[1:].view(256, 128)
    assert not rows_hopper.usable(shifted, w, DEFAULT_TILE_M, None)  # A's base 2 bytes off 16
    narrow = torch.zeros(256, 100, dtype=a.dtype, device=device)  # rows of 200 bytes
    assert not rows_hopper.usable(narrow, w[:, :, :100].contiguous(), DEFAULT_TILE_M, None)
    assert not rows_hopper.usable(a, w[:, :100], DEFAULT_TILE_M, None)  # y's rows: H = 100, 200 bytes
    assert not rows_hopper.usable(a, w, DEFAULT_TILE_M, torch.zeros(2, 256, dtype=a.dtype, device=device))
    assert not rows_hopper.usable(a.float(), w.float(), DEFAULT_TILE_M, None)
    assert not rows_hopper.usable(a, w, 64, None)  # row tiles of the schedule other than its 128
    w13 = torch.zeros(2, 256, 128, dtype=torch.bfloat16, device=device)  # I = 128: one fc1 tile
    assert rows_hopper.gate_up_usable(a, w13, DEFAULT_TILE_M, True, False) == (on_hopper and with_gluon)
    assert not rows_hopper.gate_up_usable(shifted, w13, DEFAULT_TILE_M, True, False)  # x's base off 16
    assert not rows_hopper.gate_up_usable(a, w13, DEFAULT_TILE_M, False, False)  # not gated
    assert not rows_hopper.gate_up_usable(a, w13, DEFAULT_TILE_M, True, True)  # the fc1 bias
    assert not rows_hopper.gate_up_usable(a, w13[:, :192], DEFAULT_TILE_M, True, False)  # I = 96
    monkeypatch.setenv("MOK_HOPPER_ROWS", "0")
    assert not rows_hopper.usable(a, w, DEFAULT_TILE_M, None)
    assert not rows_hopper.gate_up_usable(a, w13, DEFAULT_TILE_M, True, False)


# Each K step's wgmma per warpgroup: fc2 four m64n256k16 (64 rows of a 128 x 256 tile), fc1 eight
# m64n128k16 (the gate and the up accumulator, 64 rows of 128 x 128 each).
COMPILED = {"compile_down_fwd_hopper": ("m64n256k16", 4), "compile_gate_up_fwd_hopper": ("m64n128k16", 8)}


@pytest.mark.parametrize("compile_fn", list(COMPILED))
def test_hopper_row_gemms_compile_for_sm90_without_a_gpu(compile_fn):
    # As the launcher specialises a bf16 call, in its own process (outside the interpreter the test
    # session turns on): its shared memory fits Hopper's 227 KiB, nothing spills, and the MMAs are
    # the wgmma its tiles need, on operands in shared memory.
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    shape, count = COMPILED[compile_fn]
    code = (
        f"from mok_plugin.bench.inspect import {compile_fn}, resource_usage\n"
        f"k = {compile_fn}()\n"
        f"wgmma = k.asm['ptx'].count('wgmma.mma_async.sync.aligned.{shape}')\n"
        "print(k.metadata.shared, *resource_usage(k.asm['cubin']), wgmma)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    shared, registers, stack, wgmma = map(int, run.stdout.split()[-4:])
    assert shared <= 227 * 1024
    assert stack == 0, f"{stack} bytes of stack per thread: registers spill"
    assert 0 < registers <= rows_hopper.wgrad_hopper.MAX_REGS
    assert wgmma == count
