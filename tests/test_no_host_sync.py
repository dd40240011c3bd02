"""The hot path never reads device data on the host: routing, the schedule and the layer forward
and backward (triton backend) run without `.item()`-style reads or data-dependent shapes.

Checked with a TorchDispatchMode that fails on the ATen ops behind a host read (`.item()`,
`bool(tensor)`) and behind data-dependent output shapes (nonzero, boolean indexing, bincount,
unique), so the check works on CPU tensors too, where a real sync costs nothing."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.routing import route
from mok_plugin.schedule import build_schedule
from mok_plugin.testing import make_layer_inputs

_HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "item")


class _FailOnHostRead(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if any(name.startswith(bad) for bad in _HOST_READS):
            raise AssertionError(f"host read or data-dependent shape in the hot path: aten.{name}")
        return func(*args, **(kwargs or {}))


def test_detector_catches_item():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), _FailOnHostRead():
        torch.ones(2).sum().item()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_routing_and_schedule(impl):
    if impl == "triton":
        pytest.importorskip("triton", reason="the triton schedule needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = make_layer_inputs(50, 16, device=device, seed=1)
    with _FailOnHostRead():
        r = route(
            logits,
            top_k=4,
            score_function="sigmoid",
            n_group=4,
            topk_group=2,
            aux_loss_coeff=0.01,
            z_loss_coeff=0.001,
            expert_bias=torch.zeros(16, device=device),
        )
        build_schedule(r.topk_ids, 16, tile_m=32, capacity=20, impl=impl)


def test_layer_forward_backward_triton_backend():
    pytest.importorskip("triton", reason="the triton backend needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = MoKConfig(
        hidden_size=32,
        ffn_hidden_size=16,
        num_experts=8,
        top_k=2,
        num_shared_experts=1,
        capacity_factor=1.0,
        aux_loss_coeff=0.01,
        backend="triton",
    )
    layer = MoKMoE(cfg, seed=0, device=device)
    x = make_layer_inputs(40, 32, device=device, seed=2).requires_grad_()
    with _FailOnHostRead():
        out, aux = layer(x)
        (out.sum() + aux).backward()
