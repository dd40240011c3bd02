"""Triton backend against the reference backend at small shapes: forward, every gradient (x,
routing weights, both expert weights), edge cases (T = 1, an expert with no rows, every row on one
expert, skewed routing, H and I not multiples of the block, capacity drops), bitwise repeatability,
the layer end to end, the ops' schemas (opcheck) and torch.compile(fullgraph=True).

Without CUDA this runs in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1) in
fp32 and fp16: the interpreter's bf16 tl.dot is unreliable. With CUDA the same tests run compiled.
"""

import functools

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton backend needs triton")

from mok_plugin import (  # noqa: E402
    MoKConfig,
    MoKMoE,
    ops,  # noqa: E402
)
from mok_plugin.kernels.configs import parse_tile_config  # noqa: E402
from mok_plugin.reference import moe_experts_reference  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def _routing(T: int, E: int, K: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    if kind == "one_expert":  # every first choice on expert E-1, the rest spread
        ids = torch.stack([torch.randperm(E - 1, generator=generator)[: K - 1] for _ in range(T)]) if K > 1 else None
        first = torch.full((T, 1), E - 1)
        return first if ids is None else torch.cat([first, ids], dim=1)
    if kind == "skewed":  # expert e chosen with probability ~ 2^-e; experts past the tail stay empty
        probs = 2.0 ** -torch.arange(E, dtype=torch.float64)
        return torch.stack([torch.multinomial(probs, K, replacement=False, generator=generator) for _ in range(T)])
    raise ValueError(kind)


def _run(fn, x, w, w13, w2, schedule, probe):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    out = fn(*leaves, schedule)
    (out.float() * probe).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _compare(T, H, I, E, K, kind, dtype, seed=0, capacity=None, variant="megakernel"):
    g = torch.Generator().manual_seed(seed)
    ids = _routing(T, E, K, kind, g).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w = torch.rand(T, K, generator=g).to(DEVICE)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    probe = torch.randn(T, H, generator=g).to(DEVICE)
    schedule = build_schedule(ids, E, tile_m=DEFAULT_TILE_M, capacity=capacity)
    triton_fn = functools.partial(ops.moe_experts, variant=variant)
    got = _run(triton_fn, x, w, w13, w2, schedule, probe)
    want = _run(moe_experts_reference, x, w, w13, w2, schedule, probe)
    rows = max(1, T * K // E)
    names = ["output", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]
    reduce = [1, 2 * I, H, rows, rows]
    for name, a, b, n in zip(names, got, want, reduce, strict=True):
        assert_close(a, b, dtype, name, n_reduce=n)
    again = _run(triton_fn, x, w, w13, w2, schedule, probe)
    for name, a, b in zip(names, got, again, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"
    return got


VARIANTS = [pytest.param("megakernel", id="mega"), pytest.param("multi_kernel", id="multi")]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, H, I, E, K, kind",
    [
        pytest.param(40, 64, 32, 4, 2, "uniform", id="uniform"),
        pytest.param(1, 64, 32, 4, 2, "uniform", id="T1"),  # a single token: most experts empty
        pytest.param(50, 40, 24, 6, 3, "uniform", id="H_I_not_block_multiples"),  # masks on every edge
        pytest.param(60, 32, 32, 5, 2, "one_expert", id="all_first_choices_on_one_expert"),
        pytest.param(70, 32, 16, 8, 2, "skewed", id="skewed_with_empty_experts"),
        pytest.param(130, 32, 16, 3, 1, "uniform", id="segment_spans_two_tiles"),  # > DEFAULT_TILE_M rows/expert
        pytest.param(4, 256, 32, 4, 2, "uniform", id="rows_fewer_than_E_times_H"),  # wide H: no config narrows
    ],
)
def test_kernels_match_reference(T, H, I, E, K, kind, dtype, variant):
    _compare(T, H, I, E, K, kind, dtype, variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_with_capacity_drops(variant):
    _compare(48, 32, 16, 4, 2, "one_expert", torch.float32, capacity=20, variant=variant)


def test_megakernel_equals_multi_kernel_bitwise():
    # Both variants run the same tile functions with the same tile shapes.
    mega = _compare(90, 48, 40, 5, 2, "skewed", torch.float32, seed=4, variant="megakernel")
    multi = _compare(90, 48, 40, 5, 2, "skewed", torch.float32, seed=4, variant="multi_kernel")
    for a, b in zip(mega, multi, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, H, I, E, K, kind",
    [
        pytest.param(90, 48, 40, 5, 2, "skewed", id="aligned"),  # every operand can back a descriptor
        pytest.param(70, 64, 24, 4, 3, "uniform", id="I_not_block_multiple"),  # TMA zero fill at the edges
        pytest.param(50, 36, 24, 6, 2, "uniform", id="H_rows_unaligned"),  # fp16 rows of 72 bytes: pointer fallback
    ],
)
def test_tile_variants_match_reference(T, H, I, E, K, kind, dtype, monkeypatch):
    # Every config variant (TMA descriptors, down_dgrad's paired accumulators, pre-gathered weight-
    # gradient rows) computes the same tiles in the same K order; TMA reads the weight gradients'
    # padding rows whole (they must hold zeros). _compare checks each against the reference and for
    # bitwise repeatability; here also against the pointer path, to rounding (numpy's matmul in
    # the interpreter rounds a transposed operand differently).
    from dataclasses import replace

    from mok_plugin.kernels import grouped_mlp

    pinned = grouped_mlp.kernel_config

    def paired(name, n_out, tma):  # down_dgrad's epilogue fused, on two accumulators of at most 64 columns
        cfg = replace(pinned(name, n_out), tma=tma)
        if name != "down_dgrad":
            return cfg
        return replace(cfg, block_n=2 * min(cfg.block_n, 64), split_n=2, split_epilogue=False)

    configs = {
        "pointer loads": lambda name, n_out: pinned(name, n_out),
        "TMA": lambda name, n_out: replace(pinned(name, n_out), tma=True),
        "TMA, paired down_dgrad": lambda name, n_out: paired(name, n_out, True),
        "paired down_dgrad": lambda name, n_out: paired(name, n_out, False),
        "pre-gathered wgrad rows": lambda name, n_out: replace(pinned(name, n_out), gather_rows=True),
        "pre-gathered wgrad rows, TMA": lambda name, n_out: replace(pinned(name, n_out), gather_rows=True, tma=True),
        "down_dgrad's separate epilogue, TMA": lambda name, n_out: replace(
            pinned(name, n_out), split_epilogue=True, tma=True
        ),
    }
    results = {}
    for label, config in configs.items():
        monkeypatch.setattr(grouped_mlp, "kernel_config", config)
        results[label] = _compare(T, H, I, E, K, kind, dtype, seed=7, variant="multi_kernel")
    names = ["output", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]
    for label, got in results.items():
        for name, a, b in zip(names, results["pointer loads"], got, strict=True):
            assert_close(b, a, dtype, f"{name} ({label} vs pointer loads)")


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("left_by_token", [True, False], ids=["dW2_like", "dW13_like"])
def test_wgrad_gathered_in_column_blocks_is_bitwise_unchanged(left_by_token, tma, monkeypatch):
    # The pre-gathered operand is copied a column block at a time to bound its memory; each block's
    # sums run over the same rows in the same order, so any block count gives the same bits.
    from mok_plugin.kernels import grouped_mlp
    from mok_plugin.kernels.configs import MoKTileConfig

    T, H, I, E, K = 70, 72, 40, 5, 2
    g = torch.Generator().manual_seed(11)
    schedule = build_schedule(_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    rows = schedule.row_to_token.shape[0]
    by_token = torch.randn(T, H, generator=g).to(DEVICE, torch.float16)
    by_row = torch.randn(rows, I, generator=g).to(DEVICE, torch.float16)
    by_row[schedule.row_to_token < 0] = 0  # the zero padding rows down_dgrad writes
    left, right = (by_token, by_row) if left_by_token else (by_row, by_token)
    segments = (schedule.row_to_token, schedule.expert_offsets, schedule.tokens_per_expert)
    cfg = MoKTileConfig(32, 32, 32, 4, 2, tma=tma, gather_rows=True)  # small blocks, compiled or interpreted

    def wgrad():
        return grouped_mlp.expert_wgrad(
            left, right, *segments, left_by_token=left_by_token, right_by_token=not left_by_token,
            segment_align=schedule.tile_m, config=cfg,
        )  # fmt: skip

    whole = wgrad()
    block = cfg.block_m if left_by_token else cfg.block_n
    monkeypatch.setattr(grouped_mlp, "GATHER_CHUNK_BYTES", rows * 2 * block)  # one block per copy
    assert len(grouped_mlp.gather_column_blocks(H, rows * 2, block)) == 3  # 32 + 32 + 8 columns
    assert torch.equal(wgrad(), whole)
    # and against the sum it stands for, per expert over its rows
    tokens = schedule.row_to_token.clamp(min=0)
    gathered = torch.where((schedule.row_to_token >= 0)[:, None], by_token[tokens].float(), 0.0)
    lhs, rhs = (gathered, by_row.float()) if left_by_token else (by_row.float(), gathered)
    starts = schedule.expert_offsets.tolist()[:E]
    want = torch.stack(
        [lhs[s : s + n].T @ rhs[s : s + n] for s, n in zip(starts, schedule.tokens_per_expert.tolist(), strict=True)]
    )
    assert_close(whole, want, torch.float16, "dW", n_reduce=T * K // E)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
def test_down_dgrad_separate_epilogue_equals_the_fused_one(tma, dtype):
    # The GEMM stores dA' in fp32 and the epilogue kernel runs the fused tile's epilogue function on
    # it, with router partials EPILOGUE_BLOCK_N columns wide: against a fused paired tile whose
    # accumulators are that wide, dh and w*A are the very same, padding rows included. Each router
    # partial is a row sum reduced in the order of its operand's register layout (compiled, an MMA
    # accumulator and a loaded block differ), so the partials agree to fp32 rounding.
    from dataclasses import replace

    from mok_plugin.kernels import grouped_mlp

    T, H, I, E, K = 50, 48, 136, 5, 2  # I = 136: three epilogue blocks, the last one partial
    g = torch.Generator().manual_seed(6)
    s = build_schedule(_routing(T, E, K, "skewed", g).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    d_out = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w_rows = ops._row_weights(torch.rand(T, K, generator=g).to(DEVICE), s.row_to_tk)
    h, _ = grouped_mlp.gate_up_fwd(x, w13, s.row_to_token, s.tile_to_expert, s.tile_m)
    width = grouped_mlp.EPILOGUE_BLOCK_N
    pinned = replace(grouped_mlp.kernel_config("down_dgrad", I), tma=tma)
    fused = replace(pinned, block_n=2 * width, split_n=2, split_epilogue=False)
    separate = replace(pinned, block_n=width, split_n=1, split_epilogue=True)
    want, got = (
        grouped_mlp.down_dgrad(d_out, w2, h, w_rows, s.row_to_token, s.tile_to_expert, s.tile_m, config=cfg)
        for cfg in (fused, separate)
    )
    for name, a, b in zip(["dh", "w*A"], want[:2], got[:2], strict=True):
        assert torch.equal(a, b), name
    assert want[2].shape == got[2].shape
    assert_close(got[2], want[2], torch.float32, "router partials", n_reduce=width)
    padding = s.row_to_token < 0
    assert not got[0][padding].any() and not got[1][padding].any()  # zero padding rows for the wgrad's TMA reads


def test_gather_column_blocks_cover_the_columns_once():
    from mok_plugin.kernels.grouped_mlp import GATHER_CHUNK_BYTES, gather_column_blocks

    assert gather_column_blocks(2048, 1000, 128) == [(0, 2048)]  # small enough: one copy
    bytes_per_col = GATHER_CHUNK_BYTES // 900  # 2048 columns would need 3 copies
    blocks = gather_column_blocks(2048, bytes_per_col, 128)
    assert blocks == [(0, 768), (768, 1536), (1536, 2048)]
    assert all((c1 - c0) * bytes_per_col <= GATHER_CHUNK_BYTES for c0, c1 in blocks)
    # a single block wider than the budget is still one block, never an empty range
    assert gather_column_blocks(100, GATHER_CHUNK_BYTES, 64) == [(0, 64), (64, 100)]


def test_unknown_variant():
    with pytest.raises(ValueError, match="kernel_variant='fast'"):
        _compare(4, 32, 16, 4, 2, "uniform", torch.float32, variant="fast")


def test_down_dgrad_rejects_a_split_tile_with_the_separate_epilogue():
    # The separate epilogue's GEMM takes the whole tile; "e/2" is refused, not silently run whole.
    from mok_plugin.kernels import grouped_mlp

    T, H, I, E, K = 8, 32, 64, 2, 2
    s = build_schedule(torch.randint(0, E, (T, K)).to(DEVICE), E, tile_m=DEFAULT_TILE_M)
    d_out, h = torch.randn(T, H).to(DEVICE), torch.randn(s.num_rows, 2 * I).to(DEVICE)
    w2, w_rows = torch.randn(E, H, I).to(DEVICE), torch.rand(s.num_rows).to(DEVICE)
    cfg = parse_tile_config("32x64x32w4s1e/2")
    with pytest.raises(ValueError, match="at most 1 accumulators, got split_n=2"):
        grouped_mlp.down_dgrad(d_out, w2, h, w_rows, s.row_to_token, s.tile_to_expert, s.tile_m, config=cfg)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_triton_backend_matches_reference(dtype):
    name = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    cfg = MoKConfig(
        hidden_size=32,
        ffn_hidden_size=24,
        num_experts=6,
        top_k=2,
        num_shared_experts=1,
        aux_loss_coeff=0.01,
        params_dtype=name,
        backend="triton",
    )
    results = []
    for backend in ("triton", "reference"):
        layer = MoKMoE(cfg.replace(backend=backend), seed=3, device=DEVICE)
        assert layer.backend == backend
        x = make_layer_inputs(33, 32, dtype=dtype, device=DEVICE, seed=4).requires_grad_()
        out, aux = layer(x)
        ((out.float() ** 2).sum() + aux).backward()
        results.append([out, x.grad] + [p.grad for p in layer.parameters()])
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert_close(a, b, dtype, f"tensor {i}", n_reduce=64)


def _op_inputs():
    g = torch.Generator().manual_seed(9)
    T, H, I, E, K = 12, 32, 16, 4, 2
    ids = _routing(T, E, K, "uniform", g).to(DEVICE)
    s = build_schedule(ids, E, tile_m=DEFAULT_TILE_M)
    rows = s.row_to_token.shape[0]
    tensors = {
        "x": torch.randn(T, H, generator=g),
        "w": torch.rand(T, K, generator=g),
        "w13": torch.randn(E, 2 * I, H, generator=g),
        "w2": torch.randn(E, H, I, generator=g),
        "h": torch.randn(rows, 2 * I, generator=g),
        "a": torch.randn(rows, I, generator=g),
    }
    return {k: v.to(DEVICE) for k, v in tensors.items()}, s


def _op_calls():
    """(op, args) of every forward op the layer runs, with differentiable inputs requiring grad."""
    t, s = _op_inputs()
    for name in ("x", "w", "w13", "w2", "h"):
        t[name].requires_grad_()
    return [
        (ops.moe_experts_fwd, (t["x"], t["w"], t["w13"], t["w2"], s.row_to_token, s.row_to_tk, s.tk_to_row,
                               s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, s.tile_m)),
        (ops.expert_up_fwd, (t["x"], t["w13"], s.row_to_token, s.tk_to_row, s.tile_to_expert, s.expert_offsets,
                             s.tokens_per_expert, s.tile_m, s.top_k)),
        (ops.expert_down_fwd, (t["h"], t["a"], t["w"], t["w2"], s.row_to_token, s.row_to_tk, s.tk_to_row,
                               s.tile_to_expert, s.expert_offsets, s.tokens_per_expert, s.tile_m)),
    ]  # fmt: skip


@pytest.mark.parametrize("index", [0, 1, 2], ids=["moe_experts_fwd", "expert_up_fwd", "expert_down_fwd"])
def test_opcheck_forward_ops(index):
    op, args = _op_calls()[index]
    # Schema, fake tensor, autograd registration; aot dispatch is covered by the compile test.
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("index", [0, 1, 2], ids=["moe_experts_fwd", "expert_up_fwd", "expert_down_fwd"])
def test_ops_do_not_mutate_their_inputs(index):
    # The schemas say mutates_args=(): check that the inputs really are untouched.
    op, args = _op_calls()[index]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    op(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert all(arg.alias_info is None for arg in op._opoverload._schema.arguments)


def test_multi_kernel_backward_frees_h_before_the_up_projection_gradients(monkeypatch):
    # The multi-kernel variant is two autograd nodes, so autograd releases the saved h [R_pad, 2I]
    # after the down node's backward: the up node's weight gradient (the backward's memory peak)
    # runs without it. Saved-tensor hooks box every saved tensor; h's box must be gone at dW13.
    import gc
    import weakref

    class Box:
        def __init__(self, tensor):
            self.tensor = tensor

    t, s = _op_inputs()
    h_shape = t["h"].shape
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


def test_compile_fullgraph():
    cfg = MoKConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, backend="triton")
    layer = MoKMoE(cfg, seed=1, device=DEVICE)
    x = make_layer_inputs(20, 32, device=DEVICE, seed=2)
    eager_out, _ = layer(x)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # CPU: check graph capture, not codegen
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    out, aux = compiled(x)
    again, _ = compiled(x)
    assert torch.equal(out, again)  # compiled runs repeat bitwise
    # Inductor may fuse the router's softmax differently from eager, so only closeness is promised.
    assert_close(out, eager_out, torch.float32, "compiled vs eager")


@pytest.mark.parametrize("variant", ["multi_kernel", "megakernel"])
def test_compile_fullgraph_backward(variant):
    # The backward through both variants' autograd nodes, compiled: gradients close to eager and
    # bitwise equal between two compiled runs.
    cfg = MoKConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, backend="triton",
                    kernel_variant=variant)  # fmt: skip
    layer = MoKMoE(cfg, seed=1, device=DEVICE)
    x = make_layer_inputs(20, 32, device=DEVICE, seed=2)

    def grads(fn):
        layer.zero_grad(set_to_none=True)
        x_leaf = x.detach().clone().requires_grad_()
        out, aux = fn(x_leaf)
        ((out.float() ** 2).sum() + aux).backward()
        return [x_leaf.grad] + [p.grad.clone() for p in layer.parameters()]

    eager = grads(layer)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    first, second = grads(compiled), grads(compiled)
    for i, (a, b, c) in enumerate(zip(eager, first, second, strict=True)):
        assert torch.equal(b, c), f"gradient {i} differs between two compiled runs"
        assert_close(b, a, torch.float32, f"gradient {i}, compiled vs eager", n_reduce=64)
