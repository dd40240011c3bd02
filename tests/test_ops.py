"""The triton backend's ops (mok_plugin/ops.py): their schemas and fakes (torch.library.opcheck),
that they do not mutate their inputs, the multi-kernel backward releasing the saved h before the
up projection's gradients, the variant switch, and torch.compile(fullgraph=True) of the forward and of
both variants' backward.

Without CUDA this runs in Triton's CPU interpreter in fp32 (compile checks graph capture with
aot_eager); with CUDA the same tests run compiled (compile with inductor).
"""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import DEVICE, compare_with_reference, crafted_routing  # noqa: E402

from mok_plugin import MoKConfig, MoKMoE, ops  # noqa: E402
from mok_plugin.experts import SWIGLU, MoKExpertFamily  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule, max_padded_rows  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs, output_and_grads  # noqa: E402


def test_unknown_variant():
    with pytest.raises(ValueError, match="kernel_variant='fast'"):
        compare_with_reference(4, 32, 16, 4, 2, "uniform", torch.float32, variant="fast")


def _op_inputs():
    g = torch.Generator().manual_seed(9)
    T, H, I, E, K = 12, 32, 16, 4, 2
    ids = crafted_routing(T, E, K, "uniform", g).to(DEVICE)
    s = build_schedule(ids, E, tile_m=DEFAULT_TILE_M)
    rows = s.row_to_token.shape[0]
    tensors = {
        "ids": ids,
        "x": torch.randn(T, H, generator=g),
        "w": torch.rand(T, K, generator=g),
        "w13": torch.randn(E, 2 * I, H, generator=g),
        "w2": torch.randn(E, H, I, generator=g),
        "h": torch.randn(rows, 2 * I, generator=g),
        "a": torch.randn(rows, I, generator=g),
        "b1": torch.randn(E, 2 * I, generator=g),
        "b2": torch.randn(E, H, generator=g),
    }
    return {k: v.to(DEVICE) for k, v in tensors.items()}, s


def _op_calls():
    """(op, args) of every forward op the layer runs, with differentiable inputs requiring grad."""
    t, s = _op_inputs()
    for name in ("x", "w", "w13", "w2", "h", "b1", "b2"):
        t[name].requires_grad_()
    swiglu = ("silu", True, None, 0.0)
    gpt_oss = ("quick_gelu", True, 0.5, 1.0)
    return [
        (ops.moe_experts_fwd, (t["x"], t["w"], t["w13"], t["w2"], s.row_to_token, s.row_to_tk, s.tk_to_row,
                               s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, s.tile_m)),
        (ops.expert_up_fwd, (t["x"], t["w13"], None, s.row_to_token, s.row_to_tk, s.tk_to_row, s.tile_to_expert,
                             s.expert_offsets, s.tokens_per_expert, s.tile_m, s.top_k, *swiglu)),
        (ops.expert_up_fwd, (t["x"], t["w13"], t["b1"], s.row_to_token, s.row_to_tk, s.tk_to_row, s.tile_to_expert,
                             s.expert_offsets, s.tokens_per_expert, s.tile_m, s.top_k, *gpt_oss)),
        (ops.expert_down_fwd, (t["h"], t["a"], t["w"], t["w2"], None, s.row_to_token, s.row_to_tk, s.tk_to_row,
                               s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, s.tile_m, *swiglu)),
        (ops.expert_down_fwd, (t["h"], t["a"], t["w"], t["w2"], t["b2"], s.row_to_token, s.row_to_tk, s.tk_to_row,
                               s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, s.tile_m, *gpt_oss)),
        (ops.expert_gather_rows, (t["x"], s.row_to_token, s.tk_to_row, s.top_k)),
        (ops.expert_bias_grad_op, (t["x"].detach(), None, s.row_to_token, s.expert_offsets, s.tokens_per_expert,
                                   True)),
        (ops.schedule_maps_op, (t["ids"], s.num_experts, s.tile_m, None, s.num_rows)),
        (ops.schedule_maps_op, (t["ids"], s.num_experts, s.tile_m, 5,
                                max_padded_rows(t["ids"].numel(), s.num_experts, s.tile_m, 5))),
    ]  # fmt: skip


OP_IDS = ["moe_experts_fwd", "expert_up_fwd", "expert_up_fwd_biased_clamped_glu", "expert_down_fwd",
          "expert_down_fwd_biased", "expert_gather_rows", "expert_bias_grad", "schedule_maps",
          "schedule_maps_capacity"]  # fmt: skip


@pytest.mark.parametrize("index", range(len(OP_IDS)), ids=OP_IDS)
def test_opcheck_forward_ops(index):
    op, args = _op_calls()[index]
    # Schema, fake tensor, autograd registration; aot dispatch is covered by the compile test.
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("index", range(len(OP_IDS)), ids=OP_IDS)
def test_ops_do_not_mutate_their_inputs(index):
    # The schemas say mutates_args=(): check that the inputs really are untouched.
    op, args = _op_calls()[index]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # None stays None
    op(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert all(arg.alias_info is None for arg in op._opoverload._schema.arguments)


@pytest.mark.parametrize("compact", [True, False], ids=["h_per_pair", "h_per_row"])
def test_multi_kernel_backward_frees_h_before_the_up_projection_gradients(monkeypatch, compact):
    # The multi-kernel variant is two autograd nodes, so autograd releases the saved h [R_pad, 2I]
    # after the down node's backward: the up node's weight gradient (the backward's memory peak)
    # runs without it. Saved-tensor hooks box every saved tensor; h's box must be gone at dW13.
    import gc
    import weakref

    class Box:
        def __init__(self, tensor):
            self.tensor = tensor

    t, s = _op_inputs()
    # this batch is small: h goes one row per (token, k) pair unless the ratio is set out of reach
    monkeypatch.setattr(ops, "COMPACT_H_MIN_RATIO", ops.COMPACT_H_MIN_RATIO if compact else 10**9)
    pairs = s.tk_to_row.shape[0]
    assert ops.compact_h(s.row_to_token.shape[0], pairs) == compact
    h_shape = (pairs, t["h"].shape[1]) if compact else t["h"].shape
    h_boxes, seen = [], {}
    real_wgrad = ops.expert_wgrad

    def pack(tensor):
        box = Box(tensor)
        if tensor.shape == h_shape:
            h_boxes.append(weakref.ref(box))
        return box

    def expert_wgrad(left, right, *args, **kwargs):
        if kwargs["right_by_token"]:  # dW13, in the up node's backward
            gc.collect()
            seen["h saved at dW13"] = [ref() is not None for ref in h_boxes]
            # nor a zero gradient for A [R_pad, I], which gets none
            seen["A-sized tensors at dW13"] = sum(
                torch.is_tensor(o) and o.shape == t["a"].shape for o in gc.get_objects()
            )
        return real_wgrad(left, right, *args, **kwargs)

    monkeypatch.setattr(ops, "expert_wgrad", expert_wgrad)
    leaves = [t[k].requires_grad_() for k in ("x", "w", "w13", "w2")]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        out = ops.moe_experts(*leaves, s, variant="multi_kernel")
    assert len(h_boxes) == 1  # h is saved once, by the down node
    out.sum().backward()
    assert seen["h saved at dW13"] == [False]
    assert seen["A-sized tensors at dW13"] == 1  # the test's own t["a"]
    assert all(leaf.grad is not None for leaf in leaves)


@pytest.fixture
def fresh_dynamo():
    """Each compile test from a clean dynamo cache, so that it compiles the shapes it names: static
    unless it asks for more (a layer compiled before at another token count would recompile with
    dynamic shapes; `test_compile_at_several_token_counts` tests that on purpose)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# 20 tokens: the one-launch schedule; 1100 (2200 pairs): the chunked one's three kernels.
@pytest.mark.parametrize("tokens", [20, 1100])
def test_compile_fullgraph(tokens, fresh_dynamo):
    cfg = MoKConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, backend="triton")
    layer = MoKMoE(cfg, seed=1, device=DEVICE)
    x = make_layer_inputs(tokens, 32, device=DEVICE, seed=2)
    eager_out, _ = layer(x)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # CPU: check graph capture, not codegen
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    out, aux = compiled(x)
    again, _ = compiled(x)
    assert torch.equal(out, again)  # compiled runs repeat bitwise
    # Inductor may fuse the router's softmax differently from eager, so only closeness is promised.
    assert_close(out, eager_out, torch.float32, "compiled vs eager")


def test_the_schedule_op_refuses_too_few_rows():
    ids = torch.randint(0, 4, (12, 2), device=DEVICE)
    with pytest.raises(ValueError, match="num_rows=64 must be a multiple of tile_m=16 and at least 80"):
        ops.schedule_maps_op(ids, 4, 16, None, 64)
    with pytest.raises(ValueError, match="num_rows=88 must be a multiple of tile_m=16"):
        ops.schedule_maps_op(ids, 4, 16, None, 88)


@pytest.mark.parametrize("variant", ["multi_kernel", "megakernel"])
def test_compile_at_several_token_counts(variant, fresh_dynamo):
    """One compiled layer called at several token counts: from the second on, dynamo compiles with the
    token count symbolic (its automatic dynamic shapes). The schedule is one opaque op there: traced
    into, its kernels' wrappers made inductor's pattern matcher assert in the backward (H200, torch
    2.11). 1100 tokens take the chunked schedule on a GPU. Outputs and gradients close to eager."""
    cfg = MoKConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, backend="triton",
                    kernel_variant=variant)  # fmt: skip
    layer = MoKMoE(cfg, seed=1, device=DEVICE)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for tokens in (20, 37, 1100 if DEVICE == "cuda" else 150):
        x = make_layer_inputs(tokens, 32, device=DEVICE, seed=tokens)
        eager, again = output_and_grads(layer, x), output_and_grads(compiled, x)
        for i, (a, b) in enumerate(zip(eager, again, strict=True)):
            assert_close(b, a, torch.float32, f"{tokens} tokens: tensor {i}, compiled vs eager", n_reduce=64)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before >= 2  # it did recompile


@pytest.mark.parametrize("variant", ["multi_kernel", "megakernel"])
def test_compile_fullgraph_backward(variant, fresh_dynamo):
    # The backward through both variants' autograd nodes, compiled: gradients close to eager and
    # bitwise equal between two compiled runs.
    cfg = MoKConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, backend="triton",
                    kernel_variant=variant)  # fmt: skip
    layer = MoKMoE(cfg, seed=1, device=DEVICE)
    x = make_layer_inputs(20, 32, device=DEVICE, seed=2)
    eager = output_and_grads(layer, x)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    first, second = output_and_grads(compiled, x), output_and_grads(compiled, x)
    for i, (a, b, c) in enumerate(zip(eager, first, second, strict=True)):
        assert torch.equal(b, c), f"tensor {i} differs between two compiled runs"
        assert_close(b, a, torch.float32, f"tensor {i}, compiled vs eager", n_reduce=64)


@pytest.mark.parametrize(
    "variant, family",
    [("multi_kernel", MoKExpertFamily(activation="quick_gelu", clamp=0.5, linear_offset=1.0, fc1_bias=True,
                                      fc2_bias=True)),
     ("multi_kernel", MoKExpertFamily(kind="linear")),
     ("megakernel", SWIGLU)],
    ids=["multi_kernel_gpt_oss", "multi_kernel_linear", "megakernel"],
)  # fmt: skip
def test_eager_calls_match_the_custom_ops_bitwise(monkeypatch, variant, family):
    # Outside torch.compile moe_experts calls the ops' functions through plain autograd.Functions
    # (no dispatcher overhead); under it, the custom ops. Same kernels: bitwise the same results.
    t, s = _op_inputs()
    H, I = t["x"].shape[1], t["w2"].shape[2]
    if family.kind == "linear":
        t["w2"] = torch.randn(t["w2"].shape[0], H, H, device=DEVICE)
    weights = {
        "gate_up_proj": None if family.kind == "linear" else t["w13"],
        "down_proj": t["w2"],
        "gate_up_bias": t["b1"] if family.fc1_bias else None,
        "down_bias": t["b2"] if family.fc2_bias else None,
    }

    def run(compiling: bool):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
        x, w = t["x"].clone().requires_grad_(), t["w"].clone().requires_grad_()
        leaves = {k: None if v is None else v.clone().requires_grad_() for k, v in weights.items()}
        out = ops.moe_experts(
            x,
            w,
            leaves["gate_up_proj"],
            leaves["down_proj"],
            s,
            variant=variant,
            family=family,
            gate_up_bias=leaves["gate_up_bias"],
            down_bias=leaves["down_bias"],
        )
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        (out * probe).sum().backward()
        return [out, x.grad, w.grad] + [v.grad for v in leaves.values() if v is not None]

    eager, through_ops = run(False), run(True)
    assert len(eager) == len(through_ops) and I > 0
    for i, (a, b) in enumerate(zip(eager, through_ops, strict=True)):
        assert b is not None and torch.equal(a, b), f"result {i}"
