"""fc2's forward and fc1's dgrad on Hopper's Gluon row kernel (kernels/rows_hopper.py, v47): on an sm_90
GPU, bitwise the Triton kernels' rows (so ranks and processes that take either agree), repeatable,
padding rows inside a tile stored as zeros even where A holds NaN there; elsewhere never chosen."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import (  # noqa: E402
    DEVICE,
    ON_HOPPER,
    WGMMA_PER_STEP,
    crafted_routing,
    gluon_sm90_report,
    hopper_only,
)

from mok_plugin.kernels import grouped_mlp, rows_hopper, wgrad_hopper  # noqa: E402
from mok_plugin.kernels.configs import kernel_config  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402

SHAPES = [
    pytest.param((700, 576, 320, 6, 2, "uniform"), id="partial_column_block"),  # 576 = 4.5 x 128, 2.25 x 256
    pytest.param((512, 384, 200, 16, 2, "skewed"), id="K_tail_and_empty_experts"),  # I = 200: 3 x 64 + 8
    pytest.param((2048, 1024, 768, 8, 4, "uniform"), id="qwen3_like"),
]


def _operands(T, H, I, E, K, kind, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, kind, g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    rows = schedule.row_to_token.shape[0]
    padding = schedule.row_to_token < 0
    a = torch.randn(rows, I, generator=g).to(DEVICE, dtype)
    a[padding] = float("nan")  # gate_up_fwd leaves A's padding rows unwritten: anything may be there
    d_h = torch.randn(rows, 2 * I, generator=g).to(DEVICE, dtype)
    d_h[padding] = 0  # down_dgrad writes zeros on dh's padding rows
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    b2 = torch.randn(E, H, generator=g).to(DEVICE, dtype)
    topk_weights = torch.rand(T, K, generator=g).to(DEVICE)
    return schedule, a, d_h, w2, w13, b2, topk_weights


@pytest.fixture(params=[(s, g) for s in wgrad_hopper.SCHEDULES for g in (1, 8)], ids=lambda p: f"{p[0]}-group{p[1]}")
def gluon_calls(request, monkeypatch):
    """Both row GEMMs on the Gluon kernel under one schedule and tile order; its launches counted."""
    calls = []
    launch = rows_hopper.row_gemm_hopper
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROW_GEMMS", ("down_fwd", "gate_up_dgrad"))
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROW_MIN_WAVES", 0)  # these shapes fill less than a wave
    monkeypatch.setattr(rows_hopper, "SCHEDULE", request.param[0])
    monkeypatch.setattr(rows_hopper, "GROUP_M", request.param[1])
    monkeypatch.setattr(rows_hopper, "row_gemm_hopper", lambda *a, **k: calls.append(k["b_k_major"]) or launch(*a, **k))
    return calls


def _down_fwd(s, a, w2, topk_weights, b2, config=None):
    return grouped_mlp.down_fwd(a, w2, topk_weights, s.row_to_tk, s.row_to_token, s.tile_to_expert, s.tile_m, config,
                                down_bias=b2)  # fmt: skip


def _gate_up_dgrad(s, d_h, w13, config=None):
    return grouped_mlp.gate_up_dgrad(d_h, w13, s.row_to_token, s.tile_to_expert, s.tile_m, config)


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES)
def test_hopper_rows_are_bitwise_the_triton_kernels(shape, bias, dtype, gluon_calls):
    s, a, d_h, w2, w13, b2, topk_weights = _operands(*shape, dtype)
    b2 = b2 if bias else None
    used = s.row_to_token >= 0
    blocks = s.tile_to_expert.repeat_interleave(s.tile_m) >= 0  # the row blocks of experts (the rest: unwritten)
    y = _down_fwd(s, a, w2, topk_weights, b2)
    d_x = _gate_up_dgrad(s, d_h, w13)
    assert gluon_calls == [True, False], "the Gluon kernel did not run both GEMMs"
    assert torch.equal(y[blocks], _down_fwd(s, a, w2, topk_weights, b2)[blocks]), "down_fwd not bitwise repeatable"
    assert torch.equal(d_x[blocks], _gate_up_dgrad(s, d_h, w13)[blocks]), "gate_up_dgrad not bitwise repeatable"
    H = w2.shape[1]
    triton_y = _down_fwd(s, a, w2, topk_weights, b2, kernel_config("down_fwd", H))
    triton_d_x = _gate_up_dgrad(s, d_h, w13, kernel_config("gate_up_dgrad", H))
    assert torch.equal(y[used], triton_y[used]), "down_fwd differs from the Triton kernel"
    assert torch.equal(d_x[used], triton_d_x[used]), "gate_up_dgrad differs from the Triton kernel"
    assert y[used].isfinite().all() and y[used].abs().sum() > 0  # not a vacuous comparison
    # padding rows inside the row blocks of experts: zeros in y though A holds NaN there (the epilogue's
    # doing); in dx what dh's zero padding rows give
    padding = ~used & blocks
    assert padding.any() and not y[padding].any() and not d_x[padding].any()


@hopper_only
@pytest.mark.gpu
def test_hopper_rows_direct_launches_give_tritons_launch_bits():
    # The Gluon kernel's launches take launch.launch's direct path after the first (its descriptors'
    # fills kept): the same bits as through Triton's own launch, at new addresses and on new values.
    from mok_plugin.kernels.launch import through_triton

    s, a, d_h, w2, w13, b2, topk_weights = _operands(2048, 1024, 768, 8, 4, "uniform", torch.bfloat16)
    blocks = s.tile_to_expert.repeat_interleave(s.tile_m) >= 0

    def down_fwd(a: torch.Tensor) -> torch.Tensor:
        y = torch.full((a.shape[0], w2.shape[1]), float("nan"), dtype=a.dtype, device=DEVICE)
        rows_hopper.row_gemm_hopper(a, w2, y, s.tile_to_expert, s.tile_m, b_k_major=True, down_bias=b2,
                                    routing=(topk_weights, s.row_to_tk))  # fmt: skip
        return y[blocks]

    with through_triton():
        by_triton = down_fwd(a)
    for _ in range(2):
        assert torch.equal(down_fwd(a), by_triton)
        assert torch.equal(down_fwd(a.clone()), by_triton)  # another address
    other = torch.randn_like(a)
    with through_triton():
        by_triton_other = down_fwd(other)
    assert torch.equal(down_fwd(other), by_triton_other) and not torch.equal(by_triton_other, by_triton)


@pytest.mark.parametrize(
    "rows, n, waves, chosen",
    [
        (8 * 128, 2048, 1, False),  # T = 1 at qwen3-30b-a3b's dimensions: 8 x 8 tiles for 132 SMs
        (130 * 128, 2048, 1, True),  # T = 37: 130 row blocks (padding included) x 8
        (17 * 128, 1024, 1, True),  # 17 x 4 = 68 tiles on a GPU of 66 SMs
        (8 * 128, 2048, 0, True),  # no rule
    ],
)
def test_the_layer_takes_the_gluon_rows_from_a_wave_of_tiles(monkeypatch, rows, n, waves, chosen):
    # The rule alone, on the CPU: the kernel said to take the GEMM, the SMs counted as a GPU would.
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROW_GEMMS", ("down_fwd",))
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROW_MIN_WAVES", waves)
    monkeypatch.setattr(rows_hopper, "usable", lambda *args, **kwargs: True)
    monkeypatch.setattr(grouped_mlp, "sm_count", lambda device: 66 if n == 1024 else 132)
    out = torch.empty(rows, n)
    assert grouped_mlp._on_hopper_rows("down_fwd", None, out, out, out, 128) is chosen
    assert not grouped_mlp._on_hopper_rows("gate_up_dgrad", None, out, out, out, 128)  # not named


def test_not_chosen_off_hopper_with_a_config_or_below_a_wave(monkeypatch):
    # The switch on, the Gluon kernel still needs an sm_90 GPU; a config asks for the Triton kernel; and
    # tiles that leave SMs idle stay on the Triton kernel (HOPPER_ROW_MIN_WAVES).
    monkeypatch.setattr(grouped_mlp, "HOPPER_ROW_GEMMS", ("down_fwd", "gate_up_dgrad"))
    monkeypatch.setattr(rows_hopper, "row_gemm_hopper", lambda *a, **k: pytest.fail("the Gluon kernel ran"))
    s, a, d_h, w2, w13, b2, topk_weights = _operands(50, 64, 40, 4, 2, "uniform", torch.float32)
    a = a.nan_to_num()
    y = _down_fwd(s, a, w2, topk_weights, b2)  # fp32 (and off Hopper): never the Gluon kernel
    assert y.shape == (s.row_to_token.shape[0], 64)
    if ON_HOPPER:
        x16 = a.to(torch.bfloat16), w2.to(torch.bfloat16)
        _down_fwd(s, *x16, topk_weights, None, kernel_config("down_fwd", 64))
        out = torch.empty(a.shape[0], 64, dtype=torch.bfloat16, device=DEVICE)
        assert rows_hopper.usable(*x16, out, s.tile_m, b_k_major=True)
        assert rows_hopper.tile_count(*out.shape) < torch.cuda.get_device_properties(DEVICE).multi_processor_count
        _down_fwd(s, *x16, topk_weights, None)  # usable, but under a wave: the Triton kernel
        assert not rows_hopper.usable(*x16, out, s.tile_m, b_k_major=False)  # W2 read as [E, K, N]: sizes differ
        assert not rows_hopper.usable(x16[0][:, :32], x16[1], out, s.tile_m, b_k_major=True)  # K differs


@pytest.mark.parametrize("epilogue", [(True, False, True), (True, True, True), (False, False, False)],
                         ids=["down_fwd", "down_fwd_bias", "gate_up_dgrad"])  # fmt: skip
@pytest.mark.parametrize("schedule", list(wgrad_hopper.SCHEDULES))
def test_hopper_rows_compile_for_sm90_without_a_gpu(schedule, epilogue):
    # As its launcher specialises a bf16 call (in a process of its own, outside the interpreter):
    # within Hopper's 227 KiB of shared memory, nothing spilled, the wgmma its tiles need.
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    shape, count = WGMMA_PER_STEP[schedule]
    shared, registers, stack, wgmma = gluon_sm90_report(f"compile_rows_hopper({schedule!r}, *{epilogue!r})", shape)
    assert shared <= 227 * 1024
    assert stack == 0, f"{stack} bytes of stack per thread: registers spill"
    assert 0 < registers <= wgrad_hopper.MAX_REGS
    assert wgmma == count
