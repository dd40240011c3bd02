"""GPU only: Megatron's partial CUDA graphs of the MoE layer (--cuda-graph-impl transformer_engine,
--cuda-graph-modules moe_router moe_preprocess) with MoKMoELayer, captured for real.

Transformer Engine is not installed here, so torch.cuda.make_graphed_callables captures what TE's
make_graphed_callables would (the layer's forward while Megatron's capture flag is up, the start of
the MoE layer; forward and backward graphs), and Megatron's `_te_cuda_graph_replay` replays it and
resumes MoK from its outputs. bf16, the triton backend, three micro-batches with force-balanced
routing (the draw's counter advances inside the graph) and expert-bias counts, against the same layer
called whole: the outputs bitwise; the gradients within bf16 rounding (inside the captured backward
the norm output's gradient adds the graph-internal and the eager parts in the order of that graph,
not of the eager autograd pass) and bitwise repeatable across two graphed runs.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("megatron.core", reason="needs megatron-core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer import cuda_graphs as megatron_cuda_graphs  # noqa: E402
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp  # noqa: E402
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from mok_plugin.megatron import use_mok  # noqa: E402
from mok_plugin.testing import assert_close  # noqa: E402

S, B, H, E, K = 256, 2, 512, 16, 4
MICRO_BATCHES = 3
FIELDS = dict(
    num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=256, moe_ffn_hidden_size=256,
    num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
    moe_token_dispatcher_type="alltoall", gradient_accumulation_fusion=False, moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.01, params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
    moe_shared_expert_intermediate_size=256, moe_router_force_load_balancing=True,
    moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
)  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_metrics_tracker():
    """Megatron's MoE metrics tracker is global: entries another test made on the CPU would meet
    this test's CUDA losses."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


def _layer(layer_class=None, **fields):
    spec = use_mok(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False))
    if layer_class is not None:
        spec.module = layer_class
    spec.submodules.self_attention = IdentityOp  # the MoE layer is what is under test
    spec.submodules.self_attn_bda = IdentityFuncOp
    spec.submodules.input_layernorm = IdentityOp
    torch.manual_seed(0)
    layer = build_module(spec, config=TransformerConfig(**FIELDS, **fields), layer_number=1)
    return layer.cuda().bfloat16().train()  # (as Megatron's Float16Module casts the model)


class _Captured(torch.nn.Module):
    """The callable TE's graph helper hands to make_graphed_callables: the layer while capturing."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states):
        return tuple(self.layer._te_cuda_graph_capture(hidden_states))


def _graphed(like):
    layer = _layer(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"])
    layer.load_state_dict(like.state_dict())
    sample = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    megatron_cuda_graphs._set_capture_start()
    try:
        graphed = torch.cuda.make_graphed_callables(_Captured(layer), (sample,), allow_unused_input=True)
    finally:
        megatron_cuda_graphs._set_capture_end()
    layer.cuda_graphs = [graphed]
    # TransformerLayer's override imports TE; torch's graphed callable takes the hidden states only.
    layer._get_te_cuda_graph_replay_args = lambda hidden_states: ((hidden_states,), {})
    # The warm-up and capture calls advanced the counters: start where the whole layer starts.
    _restore(layer, dict(like.named_buffers()))
    layer.zero_grad(set_to_none=True)
    return layer


def _train(layer, xs, gs):
    """Each micro-batch's forward and backward; (outputs, input grads, parameter grads summed over the
    micro-batches in fp32, buffers). Every gradient is taken out after its micro-batch: a graphed
    backward returns its static buffers, which the next replay overwrites (and Megatron's local graphs
    add the graphed parameters' into `main_grad`, as its DDP provides it)."""
    outs, dxs, grads = [], [], {}
    for param in layer.parameters():
        if not hasattr(param, "main_grad"):  # kept for good: a captured graph adds into this very tensor
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    for x, g in zip(xs, gs, strict=True):
        x = x.clone().requires_grad_()
        out = layer(x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)
        outs.append(out.detach().clone())
        dxs.append(x.grad.clone())
        for name, param in layer.named_parameters():
            grad = param.main_grad.clone()
            if param.grad is not None:
                grad += param.grad.float()
            grads[name] = grads[name] + grad if name in grads else grad
            param.grad = None
            param.main_grad.zero_()
    torch.cuda.synchronize()
    return outs, dxs, grads, {name: b.clone() for name, b in layer.named_buffers()}


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(S, B, H, device="cuda", generator=gen).bfloat16() for _ in range(MICRO_BATCHES)]
    gs = [torch.randn(S, B, H, device="cuda", generator=gen).bfloat16() for _ in range(MICRO_BATCHES)]
    return xs, gs


def _restore(layer, buffers) -> None:
    with torch.no_grad():
        for name, buffer in layer.named_buffers():
            buffer.copy_(buffers[name])


def _assert_matches(got, want) -> None:
    """Outputs and buffers bitwise, gradients within bf16 rounding (module docstring)."""
    for i in range(MICRO_BATCHES):
        assert torch.equal(got[0][i], want[0][i]), f"output of micro-batch {i}"
        assert_close(got[1][i], want[1][i], torch.bfloat16, f"input grad of micro-batch {i}")
    assert got[2].keys() == want[2].keys()
    for name in want[2]:  # (bf16 gradients summed in fp32)
        assert_close(got[2][name], want[2][name], torch.bfloat16, name)
    for name in want[3]:  # the counts and the draw's counter, advanced by the replays
        assert torch.equal(got[3][name], want[3][name]), name


def test_local_partial_graphs_captured_for_real(nccl_world):
    # MoETransformerLayer's own graphs (--cuda-graph-impl local): the first training step runs eagerly
    # and records, Megatron's create_cudagraphs() captures the router and postprocess stages, and
    # the next steps replay them around MoK's eager experts.
    from megatron.core import tensor_parallel
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    tensor_parallel.model_parallel_cuda_manual_seed(123, use_cudagraphable_rng=True, force_reset_rng=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device="cuda"))
    xs, gs = _inputs()
    whole = _layer()
    start = {name: b.clone() for name, b in whole.named_buffers()}
    want = _train(whole, xs, gs)
    local = _layer(MoETransformerLayer, cuda_graph_impl="local", cuda_graph_modules=["moe_router", "moe_preprocess"])
    local.load_state_dict(whole.state_dict())
    try:
        _train(local, xs[:1], gs[:1])  # the recording step
        megatron_cuda_graphs.create_cudagraphs()
        assert megatron_cuda_graphs._CudagraphGlobalRecord.cudagraph_created
        _restore(local, start)
        got = _train(local, xs, gs)
    finally:
        megatron_cuda_graphs.delete_cuda_graphs()
    _assert_matches(got, want)


def test_te_partial_graphs_captured_for_real(nccl_world):
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device="cuda"))
    xs, gs = _inputs()
    whole = _layer()
    start = {name: b.clone() for name, b in whole.named_buffers()}
    want = _train(whole, xs, gs)
    _restore(whole, start)
    graphed = _graphed(whole)
    got = _train(graphed, xs, gs)
    _assert_matches(got, want)
    # Deterministic: a second graphed run from the same state gives the same bits.
    _restore(graphed, start)
    again = _train(graphed, xs, gs)
    for part in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(again[part], got[part], strict=True))
    assert all(torch.equal(again[2][name], got[2][name]) for name in got[2])
