"""The weight gradients' Gluon kernel for Hopper (kernels/wgrad_hopper.py): on an sm_90 GPU, bitwise
the Triton kernels' sums (which every pinned weight-gradient entry gives, so expert-parallel ranks
that pick different kernels agree), close to a float64 sum, bitwise repeatable, and the same over
any column blocks of the gathered operand; off Hopper (and on the CPU) it is never chosen."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import crafted_routing  # noqa: E402

from mok_plugin.kernels import grouped_mlp, wgrad_hopper  # noqa: E402
from mok_plugin.kernels.configs import PINNED_KERNELS, kernel_config  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402

on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not on_hopper, reason="needs an sm_90 (Hopper) GPU")

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


@pytest.fixture
def gluon_calls(monkeypatch):
    """Route every weight gradient without a config to the Gluon kernel (not only the entries it
    replaces by default) and count its launches."""
    calls = []
    launch = wgrad_hopper.expert_wgrad_hopper
    monkeypatch.setattr(grouped_mlp, "HOPPER_WGRAD_REPLACES", frozenset(PINNED_KERNELS))
    monkeypatch.setattr(wgrad_hopper, "expert_wgrad_hopper", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
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
    assert gluon_calls, "the Gluon kernel did not run"
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
def test_hopper_wgrad_gathers_without_a_copy(left_by_token, gluon_calls):
    # The by-token rows are gathered inside the kernel: the call allocates dW and nothing else
    # (the Triton kernels' "wgrad" entry copies them, up to GATHER_CHUNK_BYTES at a time).
    schedule, left, right = _operands(8192, 2048, 1024, 64, 4, "uniform", left_by_token, torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    d_w = _wgrad(schedule, left, right, left_by_token)
    torch.cuda.synchronize()
    assert gluon_calls
    assert torch.cuda.max_memory_allocated() - before <= d_w.numel() * d_w.element_size() + 2**20


def test_hopper_wgrad_is_not_chosen_off_hopper(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = torch.zeros(256, 128, dtype=torch.bfloat16, device=device)
    assert wgrad_hopper.usable(rows, rows, DEFAULT_TILE_M) == on_hopper
    assert not wgrad_hopper.usable(rows.float(), rows.float(), DEFAULT_TILE_M)  # fp32: the Triton kernels
    assert not wgrad_hopper.usable(rows, rows, 32)  # segments not padded to its 64-row steps
    monkeypatch.setenv("MOK_HOPPER_WGRAD", "0")
    assert not wgrad_hopper.usable(rows, rows, DEFAULT_TILE_M)
