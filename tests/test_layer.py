"""MoKMoE: parameter names and shapes, output and aux-loss contract, token counts, the expert-bias
update, input errors that name the problem, backend selection, determinism (bitwise-equal results across
two runs in one process and across two processes), and the triton backend against the reference
backend end to end (shared expert, aux loss)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.layer import resolve_backend
from mok_plugin.testing import assert_close, make_layer_inputs

CFG = dict(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2)


def test_parameters_have_documented_names_and_shapes():
    layer = MoKMoE(MoKConfig(**CFG, num_shared_experts=2, expert_bias=True))
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {
        "router.weight": (8, 32),
        "experts.gate_up_proj": (8, 32, 32),
        "experts.down_proj": (8, 32, 16),
        "shared_experts.gate_up_proj": (64, 32),
        "shared_experts.down_proj": (32, 32),
    }
    assert "expert_bias" in layer.state_dict()
    assert "last_tokens_per_expert" not in layer.state_dict()


def test_output_shape_aux_and_counts():
    layer = MoKMoE(MoKConfig(**CFG), seed=0)
    x = make_layer_inputs(30, 32).view(3, 10, 32)
    out, aux = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert aux.dim() == 0 and aux.item() == 0.0
    assert layer.last_tokens_per_expert.dtype == torch.int64
    assert int(layer.last_tokens_per_expert.sum()) == 30 * 2
    assert int(layer.last_num_dropped) == 0


def test_expert_bias_update_from_last_counts():
    layer = MoKMoE(MoKConfig(**CFG, expert_bias=True, score_function="sigmoid", expert_bias_update_rate=0.5), seed=0)
    layer(make_layer_inputs(40, 32))
    counts = layer.last_tokens_per_expert.float()
    layer.update_expert_bias()
    assert torch.equal(layer.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    with pytest.raises(RuntimeError, match="expert_bias=true"):
        MoKMoE(MoKConfig(**CFG)).update_expert_bias()


def test_input_errors_name_the_problem():
    layer = MoKMoE(MoKConfig(**CFG))
    with pytest.raises(ValueError, match="last dimension must be hidden_size=32"):
        layer(torch.randn(4, 31))
    with pytest.raises(TypeError, match=r"dtype torch.float64 but the layer's parameters are torch.float32"):
        layer(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        layer([[0.0] * 32])
    with pytest.raises(ValueError, match="x is on meta but the layer's parameters are on cpu"):
        layer(torch.empty(4, 32, device="meta"))
    with pytest.raises(ValueError, match="ep_size=2"):
        MoKMoE(MoKConfig(**CFG, ep_size=2))


def test_non_finite_logits_caught_with_debug_checks():
    layer = MoKMoE(MoKConfig(**CFG, debug_checks=True))
    x = make_layer_inputs(6, 32)
    x[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite router logits for tokens \[3\]"):
        layer(x)


def test_capacity_drop_warns_with_debug_checks():
    cfg = MoKConfig(**CFG, capacity_factor=0.25, debug_checks=True)
    with pytest.warns(UserWarning, match="capacity_factor=0.25"):
        MoKMoE(cfg, seed=0)(make_layer_inputs(64, 32))


def test_capture_of_a_forward_that_reads_the_host_is_named(monkeypatch):
    # Under CUDA-graph capture (here pretended: no GPU) a layer whose settings read the host says
    # which settings, instead of CUDA's "operation not permitted when stream is capturing".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    layer = MoKMoE(MoKConfig(**CFG, backend="reference", debug_checks=True), seed=0)
    with pytest.raises(RuntimeError, match=r"capturing this layer.*reference backend.*debug checks"):
        layer(make_layer_inputs(6, 32))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    out, _ = layer(make_layer_inputs(6, 32))  # not capturing: runs
    assert out.shape == (6, 32)


def test_backend_selection():
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_backend("reference", torch.device("cuda")) == "reference"
    with pytest.raises(ValueError, match="backend='gpu'"):
        resolve_backend("gpu", torch.device("cpu"))


def test_backend_is_decided_where_the_parameters_are(monkeypatch):
    # PyTorch's usual order: build on the CPU, then .to("cuda"). A backend that cannot run where
    # the parameters are is an error at the first forward, and .to() decides again.
    pytest.importorskip("triton", reason="the triton backend needs triton")
    import mok_plugin.ops  # noqa: F401 - the kernels are defined for the interpreter before the switch flips

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # this CPU cannot run the triton backend now
    layer = MoKMoE(MoKConfig(**CFG, backend="triton"), seed=0)
    assert layer.backend == "unavailable"
    with pytest.raises(ValueError, match=r"mok\.backend='triton' cannot run on cpu: .*needs a CUDA device"):
        layer(make_layer_inputs(4, 32))
    if torch.cuda.is_available():
        device = "cuda"
    else:
        device = "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # now it can, in Triton's interpreter
    layer = layer.to(device)
    assert layer.backend == "triton"
    x = make_layer_inputs(4, 32, device=device)
    out, _ = layer(x)
    want, _ = MoKMoE(MoKConfig(**CFG, backend="triton"), seed=0, device=device)(x)
    assert torch.equal(out, want)


def _run_once(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    cfg = MoKConfig(
        **CFG,
        num_shared_experts=1,
        aux_loss_coeff=0.01,
        z_loss_coeff=1e-3,
        params_dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    layer = MoKMoE(cfg, seed=7, init_std=0.1)
    x = make_layer_inputs(50, 32, dtype=dtype, seed=8).requires_grad_()
    out, aux = layer(x)
    (out.float().square().sum() + aux).backward()
    result = {"out": out.detach(), "aux": aux.detach(), "d_x": x.grad}
    result.update({f"d_{n}": p.grad for n, p in layer.named_parameters()})
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_equal_across_two_runs(dtype):
    a, b = _run_once(dtype), _run_once(dtype)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_bitwise_equal_across_two_processes(tmp_path):
    # Each child process builds the layer from the same seeds and saves every result; a fresh
    # interpreter means fresh allocator state, thread pools and (on GPU) kernel caches.
    script = textwrap.dedent(
        """
        import sys, torch
        from test_layer import _run_once
        torch.save(_run_once(torch.float32), sys.argv[1])
        """
    )
    paths = [tmp_path / f"run{i}.pt" for i in range(2)]
    for path in paths:
        # The child imports this module from the tests folder, as pytest does.
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])),
        }
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=300, env=env)
    a, b = (torch.load(p) for p in paths)
    here = _run_once(torch.float32)
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(a[name], here[name]), name


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_is_batch_invariant(backend):
    # README, 'What it promises': a token's output does not depend on which other tokens share the batch. Without a
    # GPU the triton backend runs in Triton's interpreter (tests/conftest.py).
    if backend == "triton":
        pytest.importorskip("triton", reason="the triton backend needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = MoKConfig(hidden_size=48, ffn_hidden_size=40, num_experts=6, top_k=2, num_shared_experts=1,
                    score_function="softmax", norm_topk_prob=True, backend=backend)  # fmt: skip
    layer = MoKMoE(cfg, seed=0, init_std=0.2, device=device)
    x = make_layer_inputs(300, 48, seed=1, device=device)
    with torch.no_grad():
        full, _ = layer(x)
        for start, stop in [(0, 37), (100, 250), (299, 300)]:
            part, _ = layer(x[start:stop].clone())
            assert torch.equal(full[start:stop], part), f"tokens {start}:{stop} changed with the batch"


# The triton backend runs compiled on a GPU, in Triton's CPU interpreter without one (conftest.py).
_TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
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
        layer = MoKMoE(cfg.replace(backend=backend), seed=3, device=_TRITON_DEVICE)
        assert layer.backend == backend
        x = make_layer_inputs(33, 32, dtype=dtype, device=_TRITON_DEVICE, seed=4).requires_grad_()
        out, aux = layer(x)
        ((out.float() ** 2).sum() + aux).backward()
        results.append([out, x.grad] + [p.grad for p in layer.parameters()])
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert_close(a, b, dtype, f"tensor {i}", n_reduce=64)
