"""Deferred expert weight gradients (mok_plugin/wgrad.py, Megatron's --delay-wgrad-compute).

Under `deferring(queue)` the experts' backward computes the data gradients and records the weight
and bias gradients; `queue.run()` computes them. For both backends (the Triton one in its CPU
interpreter on the CPU, compiled on a GPU; fp32), for families with and without biases and of every
kind: before `run()` the weights have no gradient, x and the routing weights already have theirs;
after it every gradient is bitwise the one the undeferred backward gives, and accumulates over two
backward passes the same way. The megakernel computes its weight gradients in its single pass
(nothing to defer); a weight that is not a leaf is never deferred; a layer whose deferred gradients
were never computed refuses to run its next forward.
"""

import functools

import pytest
import torch

from mok_plugin import MoKConfig, MoKMoE, ops
from mok_plugin.reference import moe_experts_reference
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule
from mok_plugin.testing import EXPERT_FAMILIES, make_layer_inputs
from mok_plugin.wgrad import DeferredWeightGrads, deferring

BACKENDS = {
    "reference": moe_experts_reference,
    "triton_multi_kernel": functools.partial(ops.moe_experts, variant="multi_kernel"),
}
FAMILIES = ["swiglu", "gpt_oss", "mlp_gelu_bias", "linear_bias"]
T, H, I, E, K = 24, 32, 16, 4, 2
WEIGHT_NAMES = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def _inputs(family, seed: int = 3):
    from triton_cases import DEVICE, crafted_routing, family_weights

    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(crafted_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    w = torch.rand(T, K, generator=g).to(DEVICE)
    weights = family_weights(E, H, I, family, g, DEVICE, torch.float32)
    probes = [torch.randn(T, H, generator=g).to(DEVICE) for _ in range(2)]
    return x, w, weights, schedule, probes


def _two_backwards(fn, x, w, weights, schedule, probes, family, queue=None):
    """Two forward-backward passes into the same leaves; the queue (if any) run after each.
    Returns (d_x and d_w of the first pass, the weights' accumulated gradients, their gradients
    just before the first run())."""
    leaves = {k: None if t is None else t.clone().requires_grad_() for k, t in weights.items()}
    data_grads, before_run = None, None
    for probe in probes:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with deferring(queue):
            out = fn(xi, wi, leaves["gate_up_proj"], leaves["down_proj"], schedule, family=family,
                     gate_up_bias=leaves["gate_up_bias"], down_bias=leaves["down_bias"])  # fmt: skip
        (out * probe).sum().backward()
        if data_grads is None:
            data_grads = (xi.grad, wi.grad)
        if queue is not None:
            if before_run is None:
                before_run = {k: None if t is None else t.grad for k, t in leaves.items()}
            queue.run()
    return data_grads, {k: t.grad for k, t in leaves.items() if t is not None}, before_run


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_deferred_weight_grads_are_the_same_bits(backend, family_name):
    family = EXPERT_FAMILIES[family_name]
    x, w, weights, schedule, probes = _inputs(family)
    fn = BACKENDS[backend]
    want_data, want, _ = _two_backwards(fn, x, w, weights, schedule, probes, family)
    queue = DeferredWeightGrads()
    got_data, got, before_run = _two_backwards(fn, x, w, weights, schedule, probes, family, queue)
    assert all(g is None for g in before_run.values()), "a weight gradient was computed in the backward"
    assert queue.completed == 2 * (1 if backend == "reference" else 2 - (family.kind == "linear")), queue.completed
    for a, b, name in zip(got_data, want_data, ("d_x", "d_topk_weights"), strict=True):
        assert torch.equal(a, b), name
    assert set(got) == set(want) and len(got) >= 2
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name
        assert grad.abs().sum() > 0, name  # fresh random inputs: no all-zero gradient to agree on


def test_megakernel_and_non_leaf_weights_compute_at_once():
    family = EXPERT_FAMILIES["swiglu"]
    x, w, weights, schedule, probes = _inputs(family)
    queue = DeferredWeightGrads()
    mega = functools.partial(ops.moe_experts, variant="megakernel")
    _, grads, before_run = _two_backwards(mega, x, w, weights, schedule, probes[:1], family, queue)
    assert queue.completed == 0 and all(before_run[k] is not None for k in ("gate_up_proj", "down_proj"))

    # A weight that reached the experts through another node (here a cast) is not deferred.
    leaf = weights["down_proj"].double().requires_grad_()
    xi = x.clone().requires_grad_()
    with deferring(queue):
        out = moe_experts_reference(xi, w, weights["gate_up_proj"], leaf.float(), schedule, family=family)
    out.sum().backward()
    assert leaf.grad is not None and len(queue) == 0


def test_layer_refuses_to_go_on_with_deferred_grads_left():
    torch.manual_seed(0)
    layer = MoKMoE(MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=K, backend="reference"))
    layer.weight_grads = DeferredWeightGrads()
    x = make_layer_inputs(T, H, seed=1)
    out, _ = layer(x)
    out.sum().backward()
    assert layer.experts.down_proj.grad is None and len(layer.weight_grads) == 1
    with torch.no_grad():
        layer(x)  # evaluation records nothing and may run
    with pytest.raises(RuntimeError, match="never computed"):
        layer(x)
    layer.weight_grads.run()
    assert layer.experts.down_proj.grad is not None
    layer(x)
