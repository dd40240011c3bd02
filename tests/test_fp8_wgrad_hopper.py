"""The blockwise-FP8 weight gradients' Gluon kernel for Hopper (kernels/fp8_wgrad_hopper.py, issue 25):
off unless MOK_HOPPER_FP8_WGRAD asks for it; compiled for sm_90 on the CPU, it fits Hopper's shared
memory without spilling and overlaps each step's promotion with the next step's MMA; on an sm_90 GPU,
bitwise the Triton kernel's sums (`fp8_mlp.fp8_wgrad`), close to a float64 sum, bitwise repeatable,
and the same gradients through the FP8 backward."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the FP8 kernels need triton")

from triton_cases import crafted_routing, hopper_only  # noqa: E402

from mok_plugin.kernels import fp8_mlp, fp8_wgrad_hopper  # noqa: E402
from mok_plugin.schedule import build_schedule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def test_off_unless_the_environment_names_a_schedule(monkeypatch):
    monkeypatch.delenv("MOK_HOPPER_FP8_WGRAD", raising=False)
    assert fp8_wgrad_hopper.requested_schedule() is None
    monkeypatch.setenv("MOK_HOPPER_FP8_WGRAD", "0")
    assert fp8_wgrad_hopper.requested_schedule() is None
    for schedule in fp8_wgrad_hopper.SCHEDULES:
        monkeypatch.setenv("MOK_HOPPER_FP8_WGRAD", schedule)
        assert fp8_wgrad_hopper.requested_schedule() == schedule
    monkeypatch.setenv("MOK_HOPPER_FP8_WGRAD", "1")
    with pytest.raises(ValueError, match="MOK_HOPPER_FP8_WGRAD='1'.*cooperative"):
        fp8_wgrad_hopper.requested_schedule()


@pytest.mark.parametrize("schedule", list(fp8_wgrad_hopper.SCHEDULES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_ring_and_output_tiles_fit_hoppers_shared_memory(schedule, out_dtype):
    plan = fp8_wgrad_hopper.SCHEDULES[schedule]
    stages = fp8_wgrad_hopper.stages_for(plan, out_dtype)
    tiles = (1 + plan.pingpong) * plan.block_m * plan.block_n * out_dtype.itemsize
    assert 4 <= stages <= 8  # deep enough to run ahead across a short tile's two K steps
    assert stages * (plan.block_m + plan.block_n) * fp8_wgrad_hopper.BLOCK_K + tiles <= 227 * 1024


# (schedule, left, right, dW dtype): the hybrid recipe's dW13 multiplies E5M2 dh by E4M3 x
COMPILED = [
    ("cooperative", "e4m3", "e4m3", "bfloat16"),
    ("pingpong", "e4m3", "e4m3", "bfloat16"),
    ("cooperative", "e5m2", "e4m3", "float32"),
    ("pingpong", "e4m3", "e5m2", "float32"),
]


@pytest.mark.parametrize("schedule, left, right, out", COMPILED)
def test_compiles_for_sm90_without_a_gpu(schedule, left, right, out):
    # Compiled as its launcher specialises the call, in its own process (outside the interpreter the
    # test session turns on): its shared memory fits Hopper's 227 KiB, nothing spills, the MMAs are
    # FP8 wgmma of the operands' formats (four k32 steps per 128-row block and warpgroup function),
    # and each step waits for the previous step's MMA only (wait_group 1: the promotion overlaps).
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    code = (
        "import torch\n"
        "from mok_plugin.bench.inspect import compile_fp8_wgrad_hopper, resource_usage\n"
        f"k = compile_fp8_wgrad_hopper({schedule!r}, torch.{out}, torch.{FP8[left]}, torch.{FP8[right]})\n"
        f"ptx = k.asm['ptx']\n"
        f"mma = ptx.count('wgmma.mma_async.sync.aligned.m64n128k32.f32.{left}.{right}')\n"
        "print(k.metadata.shared, *resource_usage(k.asm['cubin']), mma, ptx.count('wgmma.wait_group.sync.aligned 1'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    shared, registers, stack, mma, overlapped_waits = map(int, run.stdout.split()[-5:])
    plan = fp8_wgrad_hopper.SCHEDULES[schedule]
    assert shared <= 227 * 1024
    assert stack == 0, f"{stack} bytes of stack per thread: registers spill"
    assert 0 < registers <= plan.max_regs
    assert mma == 4 * (1 + plan.pingpong)
    assert overlapped_waits == 1 + plan.pingpong


def test_not_chosen_off_hopper(monkeypatch):
    # Asked for on a machine without an sm_90 GPU (here: CPU tensors), the Triton kernel computes dW.
    monkeypatch.setenv("MOK_HOPPER_FP8_WGRAD", "cooperative")
    left = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    assert not fp8_wgrad_hopper.usable(left, left, torch.zeros(1, 64, 64, dtype=torch.bfloat16))


def _operands(M, N, E, T, K, kind, left, right, seed=3):
    """A 128-row schedule's segments and two FP8 operands in the kernels' layout: transposed, [M or N,
    R_pad], zeros on padding rows, power-of-two 128 x 1 scales [R_pad / 128, M or N] (as the recipe's)."""
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=128)
    rows = schedule.row_to_token.shape[0]
    pad = (schedule.row_to_token < 0).cpu()

    def operand(width, dtype):
        values = (torch.randn(width, rows, generator=g) * 8).masked_fill(pad, 0)
        scales = 2.0 ** torch.randint(-6, 7, (rows // 128, width), generator=g).float()
        return values.to(dtype).cuda(), scales.cuda()

    return schedule, operand(M, FP8[left]), operand(N, FP8[right])


def _fp8_wgrad(operands, out_dtype):
    schedule, (left_t, left_s), (right_t, right_s) = operands
    return fp8_mlp.fp8_wgrad(left_t, left_s, right_t, right_s, schedule.expert_offsets, schedule.tokens_per_expert,
                             out_dtype=out_dtype)  # fmt: skip


def _float64_sum(operands):
    schedule, (left_t, left_s), (right_t, right_s) = operands
    blocks = torch.arange(left_t.shape[1], device=left_t.device) // 128
    left = left_t.double() * left_s.double()[blocks].T
    right = right_t.double() * right_s.double()[blocks].T
    out = []
    for start, count in zip(schedule.expert_offsets.tolist(), schedule.tokens_per_expert.tolist(), strict=True):
        out.append(left[:, start : start + count] @ right[:, start : start + count].T)
    return torch.stack(out)


CASES = [
    # M, N, E, T, K, routing, left, right: empty experts and one with many 128-row blocks; M and N not
    # multiples of the tiles (TMA clips reads and the store); the hybrid recipe's mixed formats
    pytest.param(256, 384, 16, 512, 2, "skewed", "e4m3", "e4m3", id="skewed_empty_experts"),
    pytest.param(200, 72, 8, 700, 3, "uniform", "e4m3", "e4m3", id="M_N_not_tile_multiples"),
    pytest.param(384, 256, 4, 900, 2, "one_expert", "e5m2", "e4m3", id="hybrid_many_blocks"),
    pytest.param(128, 128, 32, 1, 4, "uniform", "e4m3", "e4m3", id="T1_mostly_empty"),
]


@hopper_only
@pytest.mark.parametrize("schedule", list(fp8_wgrad_hopper.SCHEDULES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, N, E, T, K, kind, left, right", CASES)
def test_bitwise_the_triton_kernel(monkeypatch, schedule, out_dtype, M, N, E, T, K, kind, left, right):
    operands = _operands(M, N, E, T, K, kind, left, right)
    monkeypatch.delenv("MOK_HOPPER_FP8_WGRAD", raising=False)
    want = _fp8_wgrad(operands, out_dtype)
    monkeypatch.setenv("MOK_HOPPER_FP8_WGRAD", schedule)
    launches = []
    launch = fp8_wgrad_hopper.fp8_wgrad_hopper
    monkeypatch.setattr(fp8_wgrad_hopper, "fp8_wgrad_hopper", lambda *a: launches.append(a[-1]) or launch(*a))
    got = _fp8_wgrad(operands, out_dtype)
    assert launches == [schedule]
    assert torch.equal(got, want)
    assert all(torch.equal(_fp8_wgrad(operands, out_dtype), got) for _ in range(3))  # bitwise repeatable
    exact = _float64_sum(operands)
    error = ((got.double() - exact).norm() / exact.norm()).item()
    assert error < (1e-2 if out_dtype == torch.bfloat16 else 1e-5), error


@hopper_only
@pytest.mark.parametrize("schedule", list(fp8_wgrad_hopper.SCHEDULES))
def test_the_fp8_backward_gives_the_same_weight_gradients(monkeypatch, schedule):
    from mok_plugin.fp8.pipeline import fp8_experts_backward, fp8_experts_forward
    from mok_plugin.fp8.recipe import E4M3, E5M2, BlockwiseFP8Recipe
    from mok_plugin.testing import EXPERT_FAMILIES

    g = torch.Generator().manual_seed(11)
    T, H, I, E, K = 600, 512, 384, 8, 2
    family = EXPERT_FAMILIES["swiglu"]
    ids = crafted_routing(T, E, K, "skewed", g)
    x = torch.randn(T, H, generator=g).cuda().bfloat16()
    weights = torch.rand(T, K, generator=g).softmax(-1).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).cuda().bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).cuda().bfloat16()
    d_out = torch.randn(T, H, generator=g).cuda().bfloat16()
    grads = {}
    for setting in ("0", schedule):
        monkeypatch.setenv("MOK_HOPPER_FP8_WGRAD", setting)
        saved: dict = {}
        run = functools.partial(fp8_experts_forward, saved=saved, family=family)
        run(x, weights, w13, w2, build_schedule(ids.cuda(), E), BlockwiseFP8Recipe(E4M3, E5M2))
        grads[setting] = fp8_experts_backward(d_out, saved)
    for name in ("d_gate_up_proj", "d_down_proj", "d_x", "d_topk_weights"):
        assert torch.equal(grads[schedule][name], grads["0"][name]), name
