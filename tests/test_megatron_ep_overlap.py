"""Megatron's EP-overlap schedule (--overlap-moe-expert-parallel-comm) through MoKMoELayer's stage
methods, on the CPU over gloo (two processes, EP 2, fp32).

Megatron 0.19's combined 1F1B schedule never calls the MoE layer's forward: it builds a
TransformerLayerSchedulePlan per layer whose nodes call shared_experts_compute, route, preprocess,
dispatch, routed_experts_compute, combine and postprocess one at a time, detach every tensor between
nodes, free some of them after use (untyped_storage().resize_(0)), and interleave one micro-batch's
forward with the previous one's backward. Its whole-model driver needs CUDA streams; the per-layer
plan does not. Here the real plan (TransformerLayerSchedulePlan.run) drives one transformer layer
over three micro-batches, paired as the schedule pairs them: forward 0 | (forward 1, backward 0) |
(forward 2, backward 1) | backward 2. Streams become None and events no-ops (one CPU stream); the
attention is an identity (Megatron's local attention needs CUDA), so the layer is the MoE MLP with
its layernorm and residual. Against the same layer run by its forward, in the same order: every
micro-batch's output and input gradient, every parameter's gradient, and the layer's statistics
(expert-bias counts) are bitwise the same, with and without a shared expert, through both exchanges,
with the aux loss and z-loss on the routing weights, on the reference backend and on the Triton one
(in its CPU interpreter). A case where MoK's experts kept the freed input (no copy) would fail with
"storage of size 0": the plan frees as the schedule does.

With --delay-wgrad-compute on too, the plan's nodes call the layer's backward_dw after the routed
experts' backward (and the pre-dispatch node's for the shared experts): the experts' weight
gradients are computed there, from what their backward recorded, and are bitwise the same again."""

import importlib.util
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from mok_plugin.megatron import use_mok  # noqa: E402
from mok_plugin.megatron.layer import set_default_mok_overrides  # noqa: E402
from mok_plugin.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.megatron

S, B, H, E = 8, 2, 32, 8
MICRO_BATCHES = 3
CASES = {
    "exact": ({}, {}),
    "shared_expert": (dict(moe_shared_expert_intermediate_size=24), {}),
    "capacity_exchange": (dict(moe_shared_expert_intermediate_size=24), dict(ep_exchange="capacity")),
    # One local expert: the schedule keeps the received rows (no copy needed).
    "one_local_expert": (dict(num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True), {}),
    "expert_bias_z_loss": (
        dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", moe_z_loss_coeff=1e-3), {}
    ),
}  # fmt: skip
if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
    # The Triton backend's two expert nodes (fc1, fc2), in Triton's CPU interpreter (conftest sets it
    # without a GPU; these gloo ranks run on the CPU): each records its own weight gradients under
    # --delay-wgrad-compute.
    CASES["triton_multi_kernel"] = (dict(moe_shared_expert_intermediate_size=24), dict(backend="triton"))
# Expert autograd nodes per micro-batch: what --delay-wgrad-compute's queue runs per backward.
EXPERT_NODES = {"reference": 1, "triton": 2}


def _layer(fields: dict, overrides: dict, world: int):
    """One transformer layer (identity attention) with MoK's MoE MLP, EP = world."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    settings = dict(
        num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=16, moe_ffn_hidden_size=16,
        num_moe_experts=E, moe_router_topk=2, expert_model_parallel_size=world, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True, gradient_accumulation_fusion=False, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    cfg = TransformerConfig(**{**settings, **fields})
    # Set after construction: Megatron's own checks of the flag want bf16 (the CPU test is fp32).
    cfg.overlap_moe_expert_parallel_comm = True
    spec = use_mok(get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False))
    spec.submodules.self_attention = IdentityOp  # Megatron's local attention needs CUDA
    spec.submodules.self_attn_bda = IdentityFuncOp
    spec.submodules.input_layernorm = IdentityOp
    set_default_mok_overrides({"backend": "reference", **overrides})
    try:
        torch.manual_seed(0)
        layer = build_module(spec, config=cfg, layer_number=1)
    finally:
        set_default_mok_overrides({})
    layer.self_attention.backward_dw = lambda: None
    return layer


def _state(layer) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (then cleared) and the layer's buffers."""
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    state = {**grads, **{f"buffer {n}": b.clone() for n, b in layer.named_buffers()}}
    counts = getattr(layer.mlp.mok, "local_tokens_per_expert", None)
    if counts is not None:
        counts.zero_()  # the expert-bias counts accumulate over micro-batches: each run counts its own
    return state


def _plain(layer, xs, gs, mask):
    """Forward 0, forward 1, backward 0, forward 2, backward 1, backward 2: the plan's order."""
    inputs = [x.clone().requires_grad_() for x in xs]
    outs = [None] * MICRO_BATCHES
    outs[0] = layer(inputs[0], attention_mask=mask)[0]
    for i in (1, 2):
        outs[i] = layer(inputs[i], attention_mask=mask)[0]
        outs[i - 1].backward(gs[i - 1])
    outs[2].backward(gs[2])
    return [o.detach() for o in outs], [x.grad for x in inputs], _state(layer)


def _planned(layer, xs, gs, mask):
    """The same through Megatron's per-layer schedule plan, as combined_1f1b pairs micro-batches."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan

    class NoEvent:  # one CPU stream: nothing to wait for or record
        def wait(self, stream):
            pass

        def record(self, stream):
            pass

    chunk = types.SimpleNamespace(
        attention_mask=mask, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, packed_seq_params=None,
        sequence_len_offset=None, model=types.SimpleNamespace(decoder=types.SimpleNamespace(final_layernorm=None)),
    )  # fmt: skip

    def plan():
        flags = {"is_first_layer": True, "is_last_layer": True}
        return TransformerLayerSchedulePlan(layer, NoEvent(), chunk, None, None, flags)

    inputs = [x.clone().requires_grad_() for x in xs]
    plans, outs = [plan()], []
    outs.append(TransformerLayerSchedulePlan.run(plans[0], None, f_input=inputs[0])[0])
    for i in (1, 2):
        plans.append(plan())
        out, grad = TransformerLayerSchedulePlan.run(
            plans[i], plans[i - 1], f_input=inputs[i], b_grad=gs[i - 1], is_last_layer_in_bwd=True
        )
        plans[i - 1].pre_dispatch_computation.backward_dw()
        inputs[i - 1].backward(grad)  # the layer input's gradient comes back; into the leaf
        outs.append(out)
    _, grad = TransformerLayerSchedulePlan.run(None, plans[2], b_grad=gs[2], is_last_layer_in_bwd=True)
    inputs[2].backward(grad)
    return [o.detach() for o in outs], [x.grad for x in inputs], _state(layer)


def _assert_same(want, got, what: str) -> None:
    for i in range(MICRO_BATCHES):
        assert torch.equal(got[0][i], want[0][i]), f"{what}: output of micro-batch {i}"
        assert torch.equal(got[1][i], want[1][i]), f"{what}: input gradient of micro-batch {i}"
    assert set(got[2]) == set(want[2]), f"{what}: {set(got[2]) ^ set(want[2])}"
    for key, value in want[2].items():
        assert torch.equal(got[2][key], value), f"{what}: {key}"


def _worker(rank: int, world: int, port: int) -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    # The plan's CUDA calls on one CPU stream: no streams, no cross-stream bookkeeping.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: None
    torch.Tensor.record_stream = lambda self, stream: None
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        mask = torch.triu(torch.ones(1, 1, S, S), diagonal=1).bool()
        generator = torch.Generator().manual_seed(100 + rank)
        xs = [torch.randn(S, B, H, generator=generator) for _ in range(MICRO_BATCHES)]
        gs = [torch.randn(S, B, H, generator=generator) for _ in range(MICRO_BATCHES)]
        for name, (fields, overrides) in CASES.items():
            layer = _layer(fields, overrides, world)
            want, got = _plain(layer, xs, gs, mask), _planned(layer, xs, gs, mask)
            _assert_same(want, got, f"{name}, rank {rank}")
            layer.config.delay_wgrad_compute = True  # the plans built from here on defer the weight gradients
            _assert_same(want, _planned(layer, xs, gs, mask), f"{name} with --delay-wgrad-compute, rank {rank}")
            queue = layer.mlp.mok.weight_grads
            # Every experts node of every micro-batch recorded its weight gradients, and backward_dw
            # ran them: nothing left.
            nodes = EXPERT_NODES[layer.mlp.mok.backend]
            assert queue is not None and len(queue) == 0 and queue.completed == nodes * MICRO_BATCHES, name
            layer.config.delay_wgrad_compute = False
            assert any(key.startswith("mlp.mok.experts.") for key in want[2]), "the experts got no gradient"
            assert layer.mlp.token_dispatcher is not None  # the stand-in the schedule may write to
            if fields.get("moe_router_enable_expert_bias"):
                counts = want[2]["buffer mlp.mok.local_tokens_per_expert"]
                assert counts.sum() == 2 * MICRO_BATCHES * S * B  # K = 2, every micro-batch once
        # TE's partial graphs (--cuda-graph-modules moe_router moe_preprocess) under the overlap: the
        # plan replays the graph (test_megatron_graph_stages' stand-in runs what TE captures) and
        # MoK's route stage resumes from its outputs; bitwise the plain layer without graphs.
        from test_megatron_graph_stages import install_capture_stand_in

        fields = dict(moe_shared_expert_intermediate_size=24, moe_router_enable_expert_bias=True,
                      moe_router_score_function="sigmoid", moe_router_force_load_balancing=True)  # fmt: skip
        graphs = dict(fields, cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"])
        plain, graphed = _layer(fields, {}, world), _layer(graphs, {}, world)
        graphed.load_state_dict(plain.state_dict())
        capture = install_capture_stand_in(graphed)
        graphed.current_microbatch = 0  # (set by the model's schedule: which of the layer's graphs replays)
        _assert_same(_plain(plain, xs, gs, mask), _planned(graphed, xs, gs, mask), f"TE partial graphs, rank {rank}")
        assert capture.calls == MICRO_BATCHES and graphed.mlp.cudagraph_tensor_store.is_empty()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_overlap_schedule_plan_is_bitwise_the_plain_layer():
    run_ranks(_worker, 2, timeout_s=300)


def test_overlap_refuses_what_its_stages_cannot_do_by_name():
    from test_megatron import _config

    from mok_plugin.config import MoKConfigError
    from mok_plugin.megatron import mok_config_from_megatron

    offload = dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"])
    mok_config_from_megatron(_config(**offload))  # alone: honoured (save_on_cpu around the layer)
    cfg = _config(**offload)
    cfg.overlap_moe_expert_parallel_comm = True  # after construction: Megatron's own checks want bf16 and EP > 1
    with pytest.raises(MoKConfigError, match="--offload-modules"):
        mok_config_from_megatron(cfg)
    zero_copy = _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep")
    zero_copy.moe_ncclep_zero_copy = True
    mok_config_from_megatron(zero_copy)  # MoK's exchange replaces the dispatcher: no effect alone
    zero_copy.overlap_moe_expert_parallel_comm = True
    with pytest.raises(MoKConfigError, match="--moe-ncclep-zero-copy"):
        mok_config_from_megatron(zero_copy)
