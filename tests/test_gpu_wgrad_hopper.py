"""The weight gradients' Gluon kernel for Hopper (kernels/wgrad_hopper.py): on an sm_90 GPU, bitwise
the Triton kernels' sums (which every pinned weight-gradient entry gives, so expert-parallel ranks
that pick different kernels agree), close to a float64 sum, bitwise repeatable, and the same over
any column blocks of the gathered operand; off Hopper (and on the CPU) it is never chosen."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import (  # noqa: E402
    ON_HOPPER,
    WGMMA_PER_STEP,
    crafted_routing,
    gluon_sm90_report,
    hopper_only,
)

from mok_plugin.kernels import grouped_mlp, wgrad_hopper  # noqa: E402
from mok_plugin.kernels.configs import PINNED_KERNELS, kernel_config  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402

SHAPES = [
    pytest.param((512, 384, 256, 16, 2, "skewed"), id="skewed_empty_experts"),
    pytest.param((4096, 1024, 768, 64, 8, "uniform"), id="qwen3_like"),
    pytest.param((700, 1000, 200, 24, 3, "uniform"), id="H_I_not_tile_multiples"),
    pytest.param((1, 512, 384, 32, 4, "uniform"), id="T1"),
]


def _operands(T, H, I, E, K, kind, left_by_token, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).cuda(), E, tile_m=DEFAULT_TILE_M)
    by_token = torch.randn(T, H, generator=g).cuda().to(dtype)
    by_row = torch.randn(schedule.row_to_token.shape[0], I, generator=g).cuda().to(dtype)
    by_row[schedule.row_to_token < 0] = 0  # the zero padding rows the kernels write
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    return schedule, left, right


@pytest.fixture(params=list(wgrad_hopper.SCHEDULES))
def gluon_calls(request, monkeypatch):
    """Route every weight gradient without a config to the Gluon kernel under one schedule (not
    only the entries it replaces by default) and count its launches."""
    calls = []
    launch = wgrad_hopper.expert_wgrad_hopper
    monkeypatch.setattr(grouped_mlp, "HOPPER_WGRAD_REPLACES", dict.fromkeys(PINNED_KERNELS, request.param))
    monkeypatch.setattr(grouped_mlp, "HOPPER_WGRAD_MIN_WIDTH", 0)
    monkeypatch.setattr(wgrad_hopper, "expert_wgrad_hopper", lambda *a: calls.append(a[-1]) or launch(*a))
    return calls


def _wgrad(schedule, left, right, left_by_token, config=None):
    return grouped_mlp.expert_wgrad(
        left, right, schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert,
        left_by_token=left_by_token, right_by_token=not left_by_token, segment_align=schedule.tile_m, config=config,
    )  # fmt: skip


def _float64_wgrad(schedule, left, right, left_by_token):
    rows = schedule.row_to_token.clamp(min=0)
    lhs = (left[rows] if left_by_token else left).double()
    rhs = right.double() if left_by_token else right[rows].double()
    keep = (schedule.row_to_token >= 0).double()[:, None]
    offsets = schedule.expert_offsets.tolist()
    return torch.stack([
        (lhs[a:b] * keep[a:b]).T @ rhs[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ])  # fmt: skip


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2_like", "dW13_like"])
@pytest.mark.parametrize("shape", SHAPES)
def test_hopper_wgrad_is_bitwise_the_triton_kernels(shape, left_by_token, dtype, gluon_calls):
    schedule, left, right = _operands(*shape, left_by_token, dtype)
    assert wgrad_hopper.usable(left, right, schedule.tile_m)
    gluon = _wgrad(schedule, left, right, left_by_token)
    again = _wgrad(schedule, left, right, left_by_token)
    assert gluon_calls and set(gluon_calls) == set(grouped_mlp.HOPPER_WGRAD_REPLACES.values()), "did not run"
    assert torch.equal(gluon, again), "not bitwise repeatable"
    by_row_width = right.shape[1] if left_by_token else left.shape[1]
    for name in ("wgrad_sweep", "wgrad", "wgrad_in_loop", "wgrad_sweep_few_rows"):
        triton_result = _wgrad(schedule, left, right, left_by_token, kernel_config(name, by_row_width))
        assert torch.equal(gluon, triton_result), f"differs from the Triton kernel {name}"
    expected = _float64_wgrad(schedule, left, right, left_by_token)
    scale = expected.abs().max().item()
    assert scale > 0
    err = (gluon.double() - expected).abs().max().item()
    assert err <= 2**-7 * scale, f"max abs err {err:.3e} against a float64 sum (scale {scale:.3e})"
    empty = schedule.tokens_per_expert == 0
    assert torch.all(gluon[empty] == 0)


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2_like", "dW13_like"])
def test_hopper_wgrad_column_blocks_change_no_bits(left_by_token, monkeypatch, gluon_calls):
    # The gathered operand is copied a column block at a time (at most GATHER_CHUNK_BYTES); each
    # block writes its slice of dW through the 3-D descriptor, clipped at the block's edge.
    schedule, left, right = _operands(2048, 1000, 640, 32, 4, "skewed", left_by_token, torch.bfloat16)
    whole = _wgrad(schedule, left, right, left_by_token)
    monkeypatch.setattr(grouped_mlp, "GATHER_CHUNK_BYTES", schedule.row_to_token.shape[0] * 2 * 300)
    blocks = grouped_mlp.gather_column_blocks(1000, schedule.row_to_token.shape[0] * 2, 128)
    assert len(blocks) > 2
    calls_whole = len(gluon_calls)
    assert torch.equal(_wgrad(schedule, left, right, left_by_token), whole)
    assert len(gluon_calls) - calls_whole == len(blocks)


def test_hopper_wgrad_is_not_chosen_off_hopper(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = torch.zeros(256, 128, dtype=torch.bfloat16, device=device)
    assert wgrad_hopper.usable(rows, rows, DEFAULT_TILE_M) == ON_HOPPER
    assert not wgrad_hopper.usable(rows.float(), rows.float(), DEFAULT_TILE_M)  # fp32: the Triton kernels
    assert not wgrad_hopper.usable(rows, rows, 32)  # segments not padded to its 64-row steps
    shifted = torch.zeros(256 * 128 + 1, dtype=rows.dtype, device=device)[1:].view(256, 128)
    assert not wgrad_hopper.usable(rows, shifted, DEFAULT_TILE_M)  # a base 2 bytes off 16: no descriptor
    assert not wgrad_hopper.usable(rows, rows.half(), DEFAULT_TILE_M)  # mixed dtypes
    monkeypatch.setenv("MOK_HOPPER_WGRAD", "0")
    assert not wgrad_hopper.usable(rows, rows, DEFAULT_TILE_M)


@pytest.mark.parametrize("schedule", list(wgrad_hopper.SCHEDULES))
def test_hopper_wgrad_compiles_for_sm90_without_a_gpu(schedule):
    # Compiled as its launcher specialises a bf16 call (outside the interpreter the test session
    # turns on, so in its own process): its shared memory fits Hopper's 227 KiB, nothing spills,
    # and the MMAs are the wgmma its tiles need.
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    shape, count = WGMMA_PER_STEP[schedule]
    shared, registers, stack, wgmma = gluon_sm90_report(f"compile_wgrad_hopper({schedule!r})", shape)
    assert shared <= 227 * 1024
    assert stack == 0, f"{stack} bytes of stack per thread: registers spill"
    assert 0 < registers <= wgrad_hopper.MAX_REGS
    assert wgmma == count
