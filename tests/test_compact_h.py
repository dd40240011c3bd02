"""h and dh one row per (token, k) pair between the multi-kernel nodes (`ops.compact_h`, the small
batches): the layer's output and every gradient bitwise those of the padded layout, for gated and
plain families with and without biases, capacity drops, one token, a rank with no tokens, and
Megatron's deferred weight gradients; and h really goes per pair. Triton's interpreter on the CPU,
compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import DEVICE, DTYPES, crafted_routing, family_weights  # noqa: E402

from mok_plugin import ops  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule, gather_rows_or_zeros  # noqa: E402
from mok_plugin.testing import EXPERT_FAMILIES  # noqa: E402
from mok_plugin.wgrad import DeferredWeightGrads, deferring  # noqa: E402

H, I, E = 32, 16, 6
CASES = [
    pytest.param(40, 2, "skewed", None, id="skewed"),
    pytest.param(40, 3, "uniform", 12, id="capacity_drops"),
    pytest.param(1, 2, "uniform", None, id="T1"),
    pytest.param(0, 2, "uniform", None, id="no_tokens"),
]


def _fwd_bwd(family, T, K, kind, capacity, dtype, compact, monkeypatch, deferred=False):
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
