"""h and dh one row per (token, k) pair between the multi-kernel nodes (`ops.compact_h`, the small
batches): the layer's output and every gradient bitwise those of the padded layout, for gated and
plain families with and without biases, capacity drops, one token, a rank with no tokens, and
Megatron's deferred weight gradients; and h really goes per pair. Triton's interpreter on the CPU,
compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import DEVICE, DTYPES, crafted_routing, family_weights, hopper_only  # noqa: E402

from mok_plugin import ops  # noqa: E402
from mok_plugin.kernels import grouped_mlp, wgrad_hopper  # noqa: E402
from mok_plugin.kernels.configs import PINNED_KERNELS  # noqa: E402
from mok_plugin.schedule import (  # noqa: E402
    DEFAULT_TILE_M,
    build_schedule,
    gather_rows_or_zeros,
    max_padded_rows,
    segment_offsets,
)
from mok_plugin.testing import EXPERT_FAMILIES  # noqa: E402
from mok_plugin.wgrad import DeferredWeightGrads, deferring  # noqa: E402

H, I, E = 32, 16, 6
CASES = [
    pytest.param(40, 2, "skewed", None, id="skewed"),
    pytest.param(40, 3, "uniform", 12, id="capacity_drops"),
    pytest.param(1, 2, "uniform", None, id="T1"),
    pytest.param(0, 2, "uniform", None, id="no_tokens"),
]


def _fwd_bwd(family, T, K, kind, capacity, dtype, compact, monkeypatch, deferred=False, dims=(H, I, E)):
    H, I, E = dims
    monkeypatch.setattr(ops, "COMPACT_H_MIN_RATIO", 2 if compact else 10**9)
    g = torch.Generator().manual_seed(17)
    ids = crafted_routing(T, E, K, kind, g).to(DEVICE) if T else torch.zeros(0, K, dtype=torch.int64, device=DEVICE)
    schedule = build_schedule(ids, E, tile_m=DEFAULT_TILE_M, capacity=capacity)
    assert ops.compact_h(schedule.row_to_token.shape[0], T * K) == compact
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype).requires_grad_()
    w = torch.rand(T, K, generator=g).to(DEVICE).requires_grad_()
    weights = {k: None if t is None else t.to(dtype).requires_grad_()
               for k, t in family_weights(E, H, I, family, g, DEVICE, torch.float32).items()}  # fmt: skip
    probe = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    queue = DeferredWeightGrads() if deferred else None
    with deferring(queue):
        out = ops.moe_experts(x, w, weights["gate_up_proj"], weights["down_proj"], schedule, family=family,
                              gate_up_bias=weights["gate_up_bias"], down_bias=weights["down_bias"])  # fmt: skip
    (out.float() * probe.float()).sum().backward()
    if queue is not None:
        queue.run()
    grads = {"out": out.detach(), "d_x": x.grad, "d_topk_weights": w.grad}
    grads |= {f"d_{k}": t.grad for k, t in weights.items() if t is not None}
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, K, kind, capacity", CASES)
@pytest.mark.parametrize("family_name", ["swiglu", "gpt_oss", "mlp_gelu_bias"])
def test_per_pair_h_gives_the_padded_layouts_bits(family_name, T, K, kind, capacity, dtype, monkeypatch):
    family = EXPERT_FAMILIES[family_name]
    per_pair = _fwd_bwd(family, T, K, kind, capacity, dtype, True, monkeypatch)
    per_row = _fwd_bwd(family, T, K, kind, capacity, dtype, False, monkeypatch)
    assert per_pair.keys() == per_row.keys()
    for name, want in per_row.items():
        assert torch.equal(per_pair[name], want), name
    if T:
        assert per_row["d_gate_up_proj"].abs().sum() > 0  # fresh random inputs: gradients to agree on


def test_per_pair_h_with_deferred_weight_gradients(monkeypatch):
    family = EXPERT_FAMILIES["gpt_oss"]  # both biases: db1 read per pair too
    per_pair = _fwd_bwd(family, 40, 2, "skewed", None, torch.float32, True, monkeypatch, deferred=True)
    per_row = _fwd_bwd(family, 40, 2, "skewed", None, torch.float32, False, monkeypatch)
    for name, want in per_row.items():
        assert torch.equal(per_pair[name], want), name


@hopper_only
@pytest.mark.gpu
@pytest.mark.parametrize("family_name", ["swiglu", "mlp_gelu_bias"])
@pytest.mark.parametrize("T, into_rows", [(512, True), (40, False)], ids=["fits", "copies_too_large"])
def test_per_pair_dh_takes_the_hopper_weight_gradient(family_name, T, into_rows, monkeypatch):
    # Where Gluon's kernel computes dW13, per-pair dh and x go into row order a column block at a
    # time (grouped_mlp.pair_wgrad_hopper) so that it does here too (routed to it at this small
    # shape; swiglu's dh in two blocks); not where the copies would outgrow the per-pair path's.
    calls, taken = [], []
    launch, pair_wgrad = wgrad_hopper.expert_wgrad_hopper, ops.pair_wgrad_hopper
    monkeypatch.setattr(grouped_mlp, "HOPPER_WGRAD_REPLACES", dict.fromkeys(PINNED_KERNELS, "pingpong"))
    monkeypatch.setattr(grouped_mlp, "HOPPER_WGRAD_MIN_WIDTH", 0)
    monkeypatch.setattr(wgrad_hopper, "expert_wgrad_hopper", lambda *a: calls.append(a) or launch(*a))
    monkeypatch.setattr(ops, "pair_wgrad_hopper", lambda *a: taken.append(pair_wgrad(*a)) or taken[-1])
    family = EXPERT_FAMILIES[family_name]
    dims = (4096, 1024, 8)
    per_pair = _fwd_bwd(family, T, 2, "skewed", None, torch.bfloat16, True, monkeypatch, dims=dims)
    assert [d_w is not None for d_w in taken] == [into_rows]
    per_row = _fwd_bwd(family, T, 2, "skewed", None, torch.bfloat16, False, monkeypatch, dims=dims)
    assert len(taken) == 1 and len(calls) >= 3, "dW2 (both layouts) or the padded dW13 not on the Gluon kernel"
    for name, want in per_row.items():
        assert torch.equal(per_pair[name], want), name
    assert per_row["d_gate_up_proj"].abs().sum() > 0


@pytest.mark.parametrize(
    "shape, blocks",
    [((4096, 7168, 2048, 384, 8), (2048, 2048)), ((4096, 7168, 2048, 256, 8), (2048, 2688)),
     ((2048, 7168, 2048, 256, 8), (2048, 1536)), ((2048, 7168, 2048, 384, 8), (2048, 768)),
     ((4096, 2880, 2880, 128, 4), None), ((512, 7168, 2048, 256, 8), None), ((256, 4096, 256, 4, 2), (512, 2176))],
    ids=["E384", "deepseek_v3_dims", "deepseek_v3_dims_T2048", "E384_T2048", "gpt_oss_dims", "deepseek_v3_dims_T512",
         "small"],
)  # fmt: skip
def test_pair_column_blocks_fit_a_copy_of_x_per_pair(shape, blocks):
    # The copies of dh and x alive at once (rows in segments padded to the Gluon kernel's 64-row K
    # step) never outgrow a copy of x per pair (T * K x H): what the Triton path held until it read x
    # through the pair map (v37), and the budget the measured peaks below the PyTorch path's rest on.
    T, H, I, E, K = shape
    rows = max_padded_rows(T * K, E, wgrad_hopper.BLOCK_K)
    budget = T * K * H * 2
    assert grouped_mlp.pair_column_blocks(rows * 2, 2 * I, H, budget) == blocks
    if blocks is not None:
        assert rows * 2 * sum(blocks) <= budget and all(width % 128 == 0 or width in (2 * I, H) for width in blocks)


def test_pair_wgrad_hopper_reads_every_row_it_copies(monkeypatch):
    # grouped_mlp.pair_wgrad_hopper anywhere (Triton's interpreter on the CPU): the Gluon kernel stood
    # in for by torch reading what it reads (ceil(count / 64) steps of 64 rows from the offsets it is
    # given), every allocation NaN (a row the copies leave out would show), dh in two blocks and x in
    # four, skewed routing (segments of 64 rows and of more), capacity drops, an empty expert and
    # empty slots; against a float64 sum over each expert's kept pairs.
    T, H, N1, E, K, tile = 300, 1024, 512, 8, 2, 128

    def gluon_stand_in(left, right, d_w, offsets, counts, schedule):
        for e in range(d_w.shape[0]):
            start, rows = offsets[e].item(), -(-counts[e].item() // 64) * 64
            d_w[e] = (left[start : start + rows].double().T @ right[start : start + rows].double()).to(d_w.dtype)

    monkeypatch.setattr(grouped_mlp, "hopper_wgrad_schedule", lambda *a: "pingpong")
    monkeypatch.setattr(grouped_mlp, "PAIR_MIN_X_BLOCK", 128)
    monkeypatch.setattr(wgrad_hopper, "expert_wgrad_hopper", gluon_stand_in)
    g = torch.Generator().manual_seed(3)
    ids = crafted_routing(T, E, K, "skewed", g)
    ids = torch.where(ids == E - 1, -1, ids).to(DEVICE)  # expert E-1 empty, and some empty slots
    s = build_schedule(ids, E, tile_m=tile, capacity=200)
    dense = segment_offsets(s.tokens_per_expert, 64)
    assert not torch.equal(dense[:-1], s.expert_offsets[:-1])  # segments under 64 rows move
    d_h, x = torch.randn(T * K, N1, generator=g).to(DEVICE), torch.randn(T, H, generator=g).to(DEVICE)
    assert grouped_mlp.pair_column_blocks(max_padded_rows(T * K, E, 64) * 4, N1, H, T * K * H * 4) == (256, 256)
    fresh = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        t = fresh(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    got = grouped_mlp.pair_wgrad_hopper(
        d_h, x, s.row_to_token, s.row_to_tk, s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, tile
    )
    monkeypatch.undo()
    kept = [(s.tile_to_expert[r // tile].item(), s.row_to_tk[r].item()) for r in range(s.row_to_tk.shape[0])]
    assert s.num_dropped > 0 and s.tokens_per_expert[-1] == 0 and (ids == -1).any()
    for e in range(E):
        pairs = torch.tensor([tk for expert, tk in kept if expert == e and tk >= 0], dtype=torch.long)
        want = d_h.cpu()[pairs].double().T @ x.cpu()[pairs // K].double()
        assert torch.allclose(got[e].cpu().double(), want, rtol=1e-5, atol=1e-5), e


def test_pairs_placed_in_row_order():
    g = torch.Generator().manual_seed(2)
    schedule = build_schedule(crafted_routing(30, E, 2, "skewed", g), E, tile_m=DEFAULT_TILE_M, capacity=8)
    pairs = torch.randn(60, 5, generator=g)
    rows = gather_rows_or_zeros(pairs, schedule.row_to_tk)
    padding = schedule.row_to_tk < 0
    assert torch.all(rows[padding] == 0)
    kept = schedule.tk_to_row >= 0  # capacity drops some pairs: they have no row
    assert 0 < kept.sum() < 60
    assert torch.equal(rows[schedule.tk_to_row[kept]], pairs[kept])
