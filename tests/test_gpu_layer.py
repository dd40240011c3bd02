"""GPU only: the triton backend in bf16 against the reference backend at real shapes (H = 2880,
T = 1, skewed routing, many experts) and for every expert family (with biases), bitwise
repeatability across runs and across processes, torch.compile(fullgraph=True) with inductor (at one
token count, and at several: dynamic shapes), and CUDA-graph capture of forward + backward.
Empty work in bf16, both kernel variants: zero tokens (also where the weight gradients copy rows
first), an expert-parallel receive buffer whose rows all miss this rank's experts or that has no
rows at all, and every row on one expert (or on 8 of 128)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from mok_plugin import MoKConfig, MoKMoE  # noqa: E402
from mok_plugin.experts import SWIGLU  # noqa: E402
from mok_plugin.testing import EXPERT_FAMILIES, assert_close, make_layer_inputs  # noqa: E402

SHAPES = [
    pytest.param((4096, 2048, 768, 128, 8), id="qwen3_like"),  # fine-grained, many experts
    pytest.param((2048, 2880, 1024, 32, 4), id="H2880"),  # H not a multiple of 128 (GPT-OSS)
    pytest.param((1, 2048, 768, 128, 8), id="T1"),  # one token: 120 experts empty
    pytest.param((1000, 1024, 4096, 8, 2), id="coarse_T_not_tile_multiple"),
]


def _layer(shape, backend, skew=False, seed=0, shared=0, family=SWIGLU):
    T, H, I, E, K = shape
    cfg = MoKConfig(
        hidden_size=H,
        ffn_hidden_size=I,
        num_experts=E,
        top_k=K,
        num_shared_experts=shared,
        params_dtype="bfloat16",
        backend=backend,
        aux_loss_coeff=1e-3,
        **family.config_fields(),
    )
    layer = MoKMoE(cfg, device="cuda", seed=seed, init_std=0.02)
    with torch.no_grad():
        if skew:  # push most tokens towards the first experts through the router weight
            layer.router.weight[: E // 8] += 0.05
        generator = torch.Generator().manual_seed(seed + 5)
        for name, param in layer.named_parameters():
            if name.endswith("_bias"):  # biases start at zero: make them random, as training would
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return layer


def _fwd_bwd(layer, x, probe):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, aux = layer(x)
    ((out.float() * probe).sum() + aux).backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_matches_reference_and_repeats(shape, skew):
    T, H, I, E, K = shape
    x = make_layer_inputs(T, H, dtype=torch.bfloat16, device="cuda", seed=1)
    probe = make_layer_inputs(T, H, device="cuda", seed=2)
    got = _fwd_bwd(_layer(shape, "triton", skew), x, probe)
    want = _fwd_bwd(_layer(shape, "reference", skew), x, probe)
    names = ["output", "d_x", "d_router", "d_gate_up_proj", "d_down_proj"]
    reduce = [1, 2 * I, T, max(1, T * K // E), max(1, T * K // E)]
    for name, a, b, n in zip(names, got, want, reduce, strict=True):
        assert_close(a, b, torch.bfloat16, name, n_reduce=n)
    again = _fwd_bwd(_layer(shape, "triton", skew), x, probe)
    for name, a, b in zip(names, got, again, strict=True):
        assert torch.equal(a, b), f"{name} not bitwise equal across runs"


@pytest.mark.parametrize("family", list(EXPERT_FAMILIES))
def test_bf16_every_expert_family_matches_reference_and_repeats(family):
    # GPT-OSS's own clamp (7.0) here: at a clamp that binds often, an h within bf16's rounding of it
    # may clamp in one backend and not the other; the interpreter and fp32 tests check the clamp.
    fam = EXPERT_FAMILIES[family]
    if fam.clamp is not None:
        fam = dataclasses.replace(fam, clamp=7.0)
    T, H, I, E, K = shape = (2048, 2880, 2880 if fam.kind == "linear" else 1024, 32, 4)
    shared = 0 if fam.kind == "linear" else 1
    x = make_layer_inputs(T, H, dtype=torch.bfloat16, device="cuda", seed=1)
    probe = make_layer_inputs(T, H, device="cuda", seed=2)
    triton_layer = _layer(shape, "triton", skew=True, shared=shared, family=fam)
    got = _fwd_bwd(triton_layer, x, probe)
    want = _fwd_bwd(_layer(shape, "reference", skew=True, shared=shared, family=fam), x, probe)
    names = ["output", "d_x"] + [f"d_{name}" for name, _ in triton_layer.named_parameters()]
    rows = max(1, T * K // E)
    for name, a, b in zip(names, got, want, strict=True):
        n_reduce = T if "router" in name or "shared" in name else rows
        assert_close(a, b, torch.bfloat16, name, n_reduce={"output": 1, "d_x": 2 * I}.get(name, n_reduce))
    again = _fwd_bwd(_layer(shape, "triton", skew=True, shared=shared, family=fam), x, probe)
    for name, a, b in zip(names, got, again, strict=True):
        assert torch.equal(a, b), f"{name} not bitwise equal across runs"


def _results_in_process():
    shape = (4096, 2048, 768, 128, 8)
    x = make_layer_inputs(shape[0], shape[1], dtype=torch.bfloat16, device="cuda", seed=1)
    probe = make_layer_inputs(shape[0], shape[1], device="cuda", seed=2)
    return [t.cpu() for t in _fwd_bwd(_layer(shape, "triton"), x, probe)]


def test_bitwise_equal_across_processes(tmp_path):
    script = textwrap.dedent(
        """
        import sys, torch
        from test_gpu_layer import _results_in_process
        torch.save(_results_in_process(), sys.argv[1])
        """
    )
    path = tmp_path / "child.pt"
    # The child imports this module from the tests folder, as pytest does.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=600, env=env)
    child = torch.load(path)
    for i, (a, b) in enumerate(zip(child, _results_in_process(), strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs between processes"


def test_compile_fullgraph_inductor():
    torch._dynamo.reset()  # static shapes, whatever this process compiled before (tests/test_ops.py: fresh_dynamo)
    shape = (512, 1024, 512, 16, 4)
    layer = _layer(shape, "triton")
    x = make_layer_inputs(512, 1024, dtype=torch.bfloat16, device="cuda", seed=3)
    probe = make_layer_inputs(512, 1024, device="cuda", seed=4)
    eager = _fwd_bwd(layer, x, probe)
    compiled = torch.compile(layer, fullgraph=True)
    results = [_fwd_bwd(compiled, x, probe) for _ in range(2)]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # compiled runs repeat bitwise
    for a, b in zip(results[0], eager, strict=True):
        assert_close(a, b, torch.bfloat16, "compiled vs eager", n_reduce=512)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compile_at_several_token_counts(dynamic):
    """Compiled once, called at token counts on both sides of the chunked schedule (2048 pairs):
    with dynamo's automatic dynamic shapes (a symbolic token count from the second count on) and
    with dynamic=True from the first. Close to eager at every count."""
    torch._dynamo.reset()
    shape = (512, 1024, 512, 16, 4)
    layer = _layer(shape, "triton")
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    for tokens in (512, 700, 3000):
        x = make_layer_inputs(tokens, 1024, dtype=torch.bfloat16, device="cuda", seed=tokens)
        probe = make_layer_inputs(tokens, 1024, device="cuda", seed=tokens + 1)
        for a, b in zip(_fwd_bwd(compiled, x, probe), _fwd_bwd(layer, x, probe), strict=True):
            assert_close(a, b, torch.bfloat16, f"{tokens} tokens, compiled vs eager", n_reduce=tokens)


def test_cuda_graph_capture_forward_backward():
    shape = (1024, 1024, 512, 16, 4)
    layer = _layer(shape, "triton")
    x = make_layer_inputs(1024, 1024, dtype=torch.bfloat16, device="cuda", seed=5).requires_grad_()
    probe = make_layer_inputs(1024, 1024, device="cuda", seed=6)

    def step():
        out, aux = layer(x)
        ((out.float() * probe).sum() + aux).backward()
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compiles kernels) outside the capture
            layer.zero_grad(set_to_none=False)
            x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for p in layer.parameters():
        p.grad.zero_()
    x.grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [out.clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    eager = _fwd_bwd(layer, x, probe)
    for i, (a, b) in enumerate(zip(replayed, eager, strict=True)):
        assert torch.equal(a, b), f"tensor {i}: graph replay differs from eager"


def test_cuda_graph_replays_draw_new_force_balancing_noise():
    # The force-balancing draw's step is a device counter the graph advances: each replay routes by
    # new noise, the noise the eager layer draws on its next call (a host int would freeze it).
    layer = _layer((512, 256, 128, 16, 4), "triton")
    layer.config = layer.config.replace(force_load_balancing=True)
    x = make_layer_inputs(512, 256, dtype=torch.bfloat16, device="cuda", seed=5)
    with torch.no_grad():
        layer(x)  # compile outside the capture
        start = layer.random_calls.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = layer(x)
        replayed = []
        for _ in range(2):
            graph.replay()
            replayed.append(out.clone())
        assert int(layer.random_calls) == int(start) + 2
        layer.random_calls.copy_(start)
        eager = [layer(x)[0] for _ in range(2)]
    assert not torch.equal(replayed[0], replayed[1]), "the two replays routed by the same noise"
    for i in range(2):
        assert torch.equal(replayed[i], eager[i]), f"replay {i} differs from the eager call"


def test_megakernel_and_multi_kernel_agree():
    # The forward tiles are the same in both variants: bitwise equal outputs. In the backward the
    # multi-kernel variant computes dA' with a 128x256 GEMM tile and its epilogue in a second kernel,
    # the megakernel with 128x64 tiles and the epilogue fused: on the H200 the gradients then differ
    # in the last bits, so they are compared to bf16 rounding (each variant repeats bitwise).
    shape = (4096, 2048, 768, 128, 8)
    T, H, I, E, K = shape
    x = make_layer_inputs(shape[0], shape[1], dtype=torch.bfloat16, device="cuda", seed=7)
    probe = make_layer_inputs(shape[0], shape[1], device="cuda", seed=8)
    results = {}
    for variant in ("megakernel", "multi_kernel"):
        layer = _layer(shape, "triton", skew=True)
        layer.config = layer.config.replace(kernel_variant=variant)
        layer._select_backend()
        results[variant] = _fwd_bwd(layer, x, probe)
    mega, multi = results["megakernel"], results["multi_kernel"]
    assert torch.equal(mega[0], multi[0]), "the forward outputs differ"
    names = ["d_x", "d_router", "d_gate_up_proj", "d_down_proj"]
    reduce = [2 * I, T, T * K // E, T * K // E]
    for name, a, b, n in zip(names, mega[1:], multi[1:], reduce, strict=True):
        assert_close(a, b, torch.bfloat16, f"{name} (megakernel vs multi-kernel)", n_reduce=n)


def test_forward_is_batch_invariant():
    # README, 'What it promises': a token's output does not depend on which other tokens share the batch. The
    # row-tile kernels own each row's arithmetic and the router scores are rounded from fp64, so
    # the first 100 tokens give the same bits alone and inside a batch of 3000, shared expert too.
    shape = (3000, 1024, 512, 32, 4)
    layer = _layer(shape, "triton", skew=True, shared=1)
    x = make_layer_inputs(3000, 1024, dtype=torch.bfloat16, device="cuda", seed=9)
    with torch.no_grad():
        full, _ = layer(x)
        part, _ = layer(x[:100].clone())
        alone, _ = layer(x[:1].clone())  # one token: the row GEMMs' tiles narrowed (spread_over_sms)
    assert torch.equal(full[:100], part)
    assert torch.equal(full[:1], alone)


@pytest.mark.parametrize("T", [1, 3])
def test_narrow_row_tiles_for_small_grids_change_no_bits(T, monkeypatch):
    # configs.spread_over_sms narrows the row GEMMs' tiles where their launch would leave SMs idle
    # (a few tokens); a tile's width must not change any result, or a token's output (and, with
    # expert parallelism, a rank's) would depend on how many rows share its launch.
    from mok_plugin.kernels import grouped_mlp

    shape = (T, 2048, 768, 128, 8)
    x = make_layer_inputs(T, 2048, dtype=torch.bfloat16, device="cuda", seed=3)
    probe = make_layer_inputs(T, 2048, device="cuda", seed=4)
    narrowed = []
    spread = grouped_mlp.spread_over_sms

    def spy(cfg, *args):
        out = spread(cfg, *args)
        narrowed.append(out.block_n < cfg.block_n)
        return out

    monkeypatch.setattr(grouped_mlp, "spread_over_sms", spy)
    got = _fwd_bwd(_layer(shape, "triton"), x, probe)
    # T = 1: all four row GEMMs (8 row blocks); T = 3: down_dgrad's only (24 x 3 programs of 128 x 256)
    assert len(narrowed) == 4 and (all(narrowed) if T == 1 else any(narrowed)), f"narrowed: {narrowed}"
    monkeypatch.setattr(grouped_mlp, "spread_over_sms", lambda cfg, *args: cfg)
    wide = _fwd_bwd(_layer(shape, "triton"), x, probe)
    for i, (a, b) in enumerate(zip(got, wide, strict=True)):
        assert torch.equal(a, b), f"tensor {i} (output, d_x, then the parameters' gradients) differs"


VARIANTS = ["multi_kernel", "megakernel"]


def _steered_layer(shape, backend, variant, chosen, shared=0):
    """A bf16 layer whose routing picks the experts in `chosen` for every token (a selection bias)."""
    T, H, I, E, K = shape
    cfg = MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=K, num_shared_experts=shared,
                    score_function="sigmoid", expert_bias=True, params_dtype="bfloat16", backend=backend,
                    kernel_variant=variant, aux_loss_coeff=1e-3)  # fmt: skip
    layer = MoKMoE(cfg, device="cuda", seed=0, init_std=0.02)
    layer.expert_bias[list(chosen)] = 100.0
    return layer


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((0, 2048, 768, 128, 8), id="qwen3_like"),
        # 2I = 4096: dW13 takes the pre-gathered path (configs.PRE_GATHER_MIN_WIDTH), which copies x rows.
        pytest.param((0, 1024, 2048, 8, 2), id="pre_gathered_wgrad"),
    ],
)
def test_bf16_zero_tokens(shape, variant):
    T, H, I, E, K = shape
    layer = _steered_layer(shape, "triton", variant, [], shared=1)
    x = torch.empty(0, H, dtype=torch.bfloat16, device="cuda")
    got = _fwd_bwd(layer, x, torch.empty(0, H, device="cuda"))
    assert got[0].shape == (0, H) and got[1].shape == (0, H)
    for (name, param), grad in zip(layer.named_parameters(), got[2:], strict=True):
        assert torch.equal(grad, torch.zeros_like(param)), f"d_{name} of no tokens is not exactly zero"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "shape, chosen",
    [
        pytest.param((2048, 2048, 768, 128, 1), [37], id="all_rows_on_one_expert"),
        pytest.param((2048, 2048, 768, 128, 8), range(8, 16), id="all_rows_on_8_of_128"),
    ],
)
def test_bf16_all_rows_on_few_experts(shape, chosen, variant):
    T, H, I, E, K = shape
    x = make_layer_inputs(T, H, dtype=torch.bfloat16, device="cuda", seed=1)
    probe = make_layer_inputs(T, H, device="cuda", seed=2)
    got = _fwd_bwd(_steered_layer(shape, "triton", variant, chosen, shared=1), x, probe)
    want = _fwd_bwd(_steered_layer(shape, "reference", variant, chosen, shared=1), x, probe)
    names = ["output", "d_x", "d_router", "d_gate_up_proj", "d_down_proj", "d_shared_gate_up", "d_shared_down"]
    reduce = [1, 2 * I, T, T, T, T, T]
    for name, a, b, n in zip(names, got, want, reduce, strict=True):
        assert_close(a, b, torch.bfloat16, name, n_reduce=n)
    idle = [e for e in range(E) if e not in set(chosen)]
    for name, grad in zip(names[3:5], got[3:5], strict=True):
        assert not grad[idle].any(), f"{name}: experts that got no row have a non-zero gradient"
    again = _fwd_bwd(_steered_layer(shape, "triton", variant, chosen, shared=1), x, probe)
    for name, a, b in zip(names, got, again, strict=True):
        assert torch.equal(a, b), f"{name} not bitwise equal across runs"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [256, 0], ids=["slots_all_empty", "no_rows"])
def test_bf16_rank_whose_experts_receive_nothing(rows, variant):
    # What an expert-parallel rank's experts see when no pair was routed to them: the capacity
    # exchange's fixed-size buffer with every slot empty (expert -1), or the exact exchange's
    # buffer of no rows. The output is zero and every gradient exactly zero.
    from mok_plugin import ops
    from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule

    H, I, E_local = 2048, 768, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = torch.rand(rows, 1, device="cuda", generator=g).requires_grad_()
    w13 = (torch.randn(E_local, 2 * I, H, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    w2 = (torch.randn(E_local, H, I, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    ids = torch.full((rows, 1), -1, dtype=torch.int64, device="cuda")
    out = ops.moe_experts(x, w, w13, w2, build_schedule(ids, E_local, tile_m=DEFAULT_TILE_M), variant=variant)
    (out.float() * torch.randn(rows, H, device="cuda", generator=g)).sum().backward()
    assert not out.any(), "rows routed nowhere produced output"
    for name, t in (("d_x", x), ("d_w", w), ("d_w13", w13), ("d_w2", w2)):
        assert t.grad is not None and not t.grad.any(), f"{name} is not exactly zero"


@pytest.mark.parametrize("gate", [False, True], ids=["plain", "gated"])
def test_shared_expert_overlap_on_a_side_stream_is_bitwise_the_same(gate):
    # mok.shared_expert_overlap runs the shared expert on a side CUDA stream while the routed experts
    # run: the same bits as in sequence, forward and backward, and repeatably.
    T, H, I, E, K = 4096, 2048, 768, 64, 8
    base = dict(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=K, num_shared_experts=1,
                shared_ffn_hidden_size=2048, shared_expert_gate=gate, params_dtype="bfloat16")  # fmt: skip
    plain = MoKMoE(MoKConfig(**base), device="cuda", seed=3)
    overlapped = MoKMoE(MoKConfig(**base, shared_expert_overlap=True), device="cuda", seed=3)
    x = make_layer_inputs(T, H, dtype=torch.bfloat16, device="cuda", seed=1)
    probe = make_layer_inputs(T, H, dtype=torch.bfloat16, device="cuda", seed=2)
    want = _fwd_bwd(plain, x, probe)
    for _ in range(2):
        got = _fwd_bwd(overlapped, x, probe)
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
