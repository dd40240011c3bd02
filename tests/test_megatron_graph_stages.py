"""Megatron's partial CUDA graphs of the MoE layer (--cuda-graph-modules moe_router [moe_preprocess])
with MoKMoELayer, on the CPU (fp32, reference backend; graph_stages.py says how Megatron runs them).

The graphs themselves need CUDA (and Transformer Engine for --cuda-graph-impl transformer_engine),
so here Megatron's own code runs the protocol around them, eagerly, and only the capture is a
stand-in:
  - transformer_engine: the layer's `cuda_graphs` hold a callable that runs what TE captures (the
    layer's forward while `is_graph_capturing()`: `_te_cuda_graph_capture`, which returns early with
    the graph's outputs); Megatron's `_te_cuda_graph_replay` then resumes the layer from them
    (cudagraph_tensor_store, the dispatcher's attributes), as after a real replay.
  - local: a MoETransformerLayer in partial mode without its two graph managers: Megatron's
    `_forward_mlp` calls the router, expert-compute and postprocess stages one by one, as it does
    around the graphed ones.
Against the same layer and weights called whole, over three micro-batches: outputs, input gradients,
every parameter's gradient and the layer's buffers (expert-bias counts, the force-balancing draw's
counter) bitwise equal. A real capture of the TE protocol runs on the GPU (tests/test_gpu_layer.py).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer import cuda_graphs as megatron_cuda_graphs  # noqa: E402
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp  # noqa: E402
from megatron.core.transformer.module import GraphableMegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_layer import MoETransformerLayer  # noqa: E402
from test_megatron import megatron_world  # noqa: E402, F401

from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.megatron.layer import set_default_mok_overrides  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_world")]

S, B, H, E = 8, 2, 32, 8
MICRO_BATCHES = 3
SHARED = dict(moe_shared_expert_intermediate_size=24)
CASES = {
    "aux_loss": {},
    "shared_expert": SHARED,
    "shared_expert_overlap": dict(SHARED, moe_shared_expert_overlap=True),
    # State the graph advances: expert-bias counts, the force-balancing draw's counter, the z-loss.
    "bias_balanced_z_loss": dict(
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", moe_z_loss_coeff=1e-3,
        moe_router_force_load_balancing=True,
    ),
}  # fmt: skip
SCOPES = {"router_preprocess": ["moe_router", "moe_preprocess"], "router": ["moe_router"]}


def _config(**fields) -> TransformerConfig:
    settings = dict(
        num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=16, moe_ffn_hidden_size=16,
        num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, gradient_accumulation_fusion=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return TransformerConfig(**{**settings, **fields})


def _layer(cfg: TransformerConfig, layer_class=None, like=None):
    """One transformer layer (identity attention: Megatron's local attention needs CUDA) with MoK's
    MoE MLP; the weights of `like` when given."""
    spec = use_mok(get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False))
    if layer_class is not None:
        spec.module = layer_class
    spec.submodules.self_attention = IdentityOp
    spec.submodules.self_attn_bda = IdentityFuncOp
    spec.submodules.input_layernorm = IdentityOp
    set_default_mok_overrides({"backend": "reference"})
    try:
        torch.manual_seed(0)
        layer = build_module(spec, config=cfg, layer_number=1)
    finally:
        set_default_mok_overrides({})
    if like is not None:
        layer.load_state_dict(like.state_dict())
    return layer.train()


def _inputs():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(S, B, H, generator=gen) for _ in range(MICRO_BATCHES)]
    gs = [torch.randn(S, B, H, generator=gen) for _ in range(MICRO_BATCHES)]
    return xs, gs


def _train(layer, xs, gs):
    """Each micro-batch's forward and backward; (outputs, input grads, parameter grads, buffers)."""
    outs, dxs = [], []
    for x, g in zip(xs, gs, strict=True):
        x = x.clone().requires_grad_()
        out = layer(x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
        outs.append(out.detach())
        dxs.append(x.grad)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    buffers = {name: b.clone() for name, b in layer.named_buffers()}
    return outs, dxs, grads, buffers


def _assert_bitwise(got, want) -> None:
    for part, (g, w) in enumerate(zip(got[:2], want[:2], strict=True)):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            assert torch.equal(a, b), f"{('output', 'input grad')[part]} of micro-batch {i} differs"
    for part in (2, 3):
        assert got[part].keys() == want[part].keys()
        for name in want[part]:
            assert torch.equal(got[part][name], want[part][name]), name


class _CaptureStandIn:
    """What TE's make_graphed_callables would capture and replay: the layer's forward while
    Megatron's capture flag is up (`_te_cuda_graph_capture`), run eagerly at every replay."""

    def __init__(self, layer):
        self.layer, self.calls = layer, 0

    def __call__(self, *args, **kwargs):
        kwargs.pop("is_first_microbatch")  # (for TE's FP8 weight caching)
        megatron_cuda_graphs._set_capture_start()
        try:
            self.calls += 1
            return tuple(self.layer._te_cuda_graph_capture(*args, **kwargs))
        finally:
            megatron_cuda_graphs._set_capture_end()


def install_capture_stand_in(layer) -> _CaptureStandIn:
    """Give `layer` (built with --cuda-graph-impl transformer_engine) its "graph": from here on
    Megatron replays it and resumes the MoE layer from its outputs."""
    capture = _CaptureStandIn(layer)
    layer.cuda_graphs = [capture]
    # TransformerLayer's override imports TE to make a CUDA attention mask; the base one is the rest.
    layer._get_te_cuda_graph_replay_args = functools.partial(
        GraphableMegatronModule._get_te_cuda_graph_replay_args, layer
    )
    return capture


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("case", list(CASES))
def test_te_partial_graph_protocol_is_bitwise_the_whole_layer(case, scope):
    fields = CASES[case]
    whole = _layer(_config(**fields))
    staged = _layer(_config(**fields, cuda_graph_impl="transformer_engine", cuda_graph_modules=SCOPES[scope]),
                    like=whole)  # fmt: skip
    xs, gs = _inputs()
    # The graph's outputs as Megatron's capture collects them: MoK returns early after routing.
    megatron_cuda_graphs._set_capture_start()
    try:
        outputs = staged(xs[0].clone().requires_grad_(), attention_mask=None)
    finally:
        megatron_cuda_graphs._set_capture_end()
    shared_in_graph = "moe_shared_expert_intermediate_size" in fields and not fields.get("moe_shared_expert_overlap")
    # [x, weights, topk_ids] (+ shared experts' output) + [residual]
    assert len(outputs) == 4 + bool(shared_in_graph)
    assert outputs[2].dtype == torch.int64 and outputs[2].shape == (S * B, 2)
    for name, buffer in staged.named_buffers():  # (the capture call counted its tokens, drew its noise)
        buffer.copy_(dict(whole.named_buffers())[name])
    staged.zero_grad(set_to_none=True)
    capture = install_capture_stand_in(staged)
    got = _train(staged, xs, gs)
    assert capture.calls == MICRO_BATCHES  # every forward went through the graph's replay
    assert staged.mlp.cudagraph_tensor_store.is_empty()  # Megatron cleared it after each resume
    _assert_bitwise(got, _train(whole, xs, gs))


@pytest.mark.parametrize("case", list(CASES))
def test_local_partial_graph_stages_are_bitwise_the_whole_layer(case, monkeypatch):
    def partial_mode_without_graphs(layer, config):
        # transition_cudagraph_scope("partial") less its CUDA event and graph managers.
        layer.use_partial_cudagraphs = True
        layer._router_dtoh_event = type(
            "NoEvent", (), {"record": lambda self: None, "synchronize": lambda self: None}
        )()

    monkeypatch.setattr(MoETransformerLayer, "create_mcore_cudagraph_manager", partial_mode_without_graphs)
    fields = CASES[case]
    whole = _layer(_config(**fields))
    staged = _layer(_config(**fields, cuda_graph_impl="local", cuda_graph_modules=["moe_router", "moe_preprocess"]),
                    MoETransformerLayer, like=whole)  # fmt: skip
    stages = []
    forward = type(staged.mlp).forward

    def recording(mlp, *args, **kwargs):
        stages.append(mlp.fwd_execution_map)
        return forward(mlp, *args, **kwargs)

    monkeypatch.setattr(type(staged.mlp), "forward", recording)
    xs, gs = _inputs()
    got = _train(staged, xs, gs)
    assert stages == ["route", "expert_compute", "postprocess"] * MICRO_BATCHES
    assert staged._local_cudagraph_attr_names == ("topk_ids",)  # the experts chosen cross as a dispatcher attribute
    _assert_bitwise(got, _train(whole, xs, gs))


def test_whole_layer_call_still_works_with_partial_scopes():
    # Evaluation (and Megatron's inference) calls the layer whole even when the scopes are set.
    fields = dict(SHARED, cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"])
    whole = _layer(_config(**SHARED))
    staged = _layer(_config(**fields), like=whole)
    x = torch.randn(S, B, H)
    with torch.no_grad():
        assert torch.equal(staged.eval()(x, attention_mask=None)[0], whole.eval()(x, attention_mask=None)[0])


@pytest.mark.parametrize(
    "fields, overrides, match",
    [
        (dict(), {"debug_checks": True}, r"moe_preprocess moe_router with --cuda-graph-impl transformer_engine.*debug"),
        # (Megatron itself refuses moe recompute with TE's moe_router graphs; local graphs recompute the stages.)
        (
            dict(cuda_graph_impl="local", recompute_granularity="selective", recompute_modules=["moe"]), None,
            r"--recompute-modules moe with --cuda-graph-modules moe_preprocess moe_router with --cuda-graph-impl local",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=["layernorm"]), None,
            r"--recompute-modules layernorm with .* alltoall",
        ),
        (
            dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]), None,
            r"--offload-modules expert_fc1 with --cuda-graph-modules",
        ),
    ],
    ids=["debug_checks", "moe_recompute", "layernorm_recompute_alltoall", "moe_offloading"],
)  # fmt: skip
def test_what_the_partial_graphs_cannot_take_is_refused_by_name(fields, overrides, match):
    scopes = dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"])
    with pytest.raises(MoKConfigError, match=match):
        mok_config_from_megatron(_config(**{**scopes, **fields}), overrides)


def test_partial_graphs_take_what_stays_outside_the_graph():
    # The exact EP exchange reads the host, but runs after the graph: accepted (a whole-layer capture
    # refuses it); layernorm recompute with the flex dispatcher (Megatron then does not free the norm).
    scopes = dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"])
    mok_config_from_megatron(_config(**scopes, expert_model_parallel_size=2))
    mok_config_from_megatron(
        _config(**scopes, recompute_granularity="selective", recompute_modules=["layernorm"],
                moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    )  # fmt: skip
