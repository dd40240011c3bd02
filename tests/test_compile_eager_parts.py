"""Settings whose experts torch.compile cannot trace (the reference backend's host loop over the
experts, mok.fp8's FP8 weight copies kept in Python between micro-batches) run those experts
eagerly inside a compiled model: torch.compile breaks the graph around them and the layer computes
what it computes eagerly; `fullgraph=True` stops with dynamo's error, whose explanation names the
setting and why. (The triton backend without FP8 compiles whole: tests/test_ops.py.)"""

import importlib.util

import pytest
import torch

from mok_plugin.config import MoKConfig
from mok_plugin.layer import MoKMoE
from mok_plugin.testing import assert_close, make_layer_inputs, output_and_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [
    pytest.param("reference", None, "the reference backend loops over the experts on the host", id="reference"),
    pytest.param("reference", "e4m3", "mok.fp8's experts keep the weights' FP8 copies", id="reference_fp8"),
    pytest.param("triton", "e4m3", "mok.fp8's experts keep the weights' FP8 copies", id="triton_fp8",
                 marks=[pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                             reason="the triton backend needs triton")]),
]  # fmt: skip


def _layer(backend: str, fp8: str | None) -> tuple[MoKMoE, torch.Tensor]:
    # Triton interpreted on the CPU takes fp16 (bf16 tl.dot is wrong there); bf16 compiled on a GPU.
    dtype = "float32" if backend == "reference" else ("bfloat16" if DEVICE == "cuda" else "float16")
    cfg = MoKConfig(hidden_size=256, ffn_hidden_size=192, num_experts=4, top_k=2, num_shared_experts=1, fp8=fp8,
                    params_dtype=dtype, backend=backend)  # fmt: skip
    layer = MoKMoE(cfg, seed=0, device=DEVICE)
    return layer, make_layer_inputs(40, 256, seed=1, dtype=getattr(torch, dtype), device=DEVICE)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend, fp8, why", CASES)
def test_compiled_model_runs_these_experts_eagerly(backend, fp8, why):
    layer, x = _layer(backend, fp8)
    eager = output_and_grads(layer, x)
    compiled = output_and_grads(torch.compile(layer, backend="aot_eager" if DEVICE == "cpu" else "inductor"), x)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks >= 1, "the experts were traced into the graph"
    for i, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        # The compiled router and sums may round differently (d_x: 5e-10 in fp32 here); the experts do not.
        assert_close(got, want, got.dtype, f"tensor {i}, compiled vs eager", n_reduce=256)


@pytest.mark.parametrize("backend, fp8, why", CASES)
def test_fullgraph_names_what_keeps_the_experts_out(backend, fp8, why):
    layer, x = _layer(backend, fp8)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=why):
        torch.compile(layer, fullgraph=True, backend="aot_eager")(x)


@pytest.mark.parametrize("backend, fp8, why", CASES[:2])
def test_such_layers_copy_and_pickle(backend, fp8, why):
    # The wrapper torch.compiler.disable makes is a closure, which pickle cannot name: the layer keeps
    # its experts function in a picklable holder (a layer is deep-copied and pickled by frameworks).
    import copy
    import pickle

    layer, x = _layer(backend, fp8)
    want, _ = layer(x)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        got, _ = twin(x)
        assert torch.equal(got, want)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=why):
            torch.compile(twin, fullgraph=True, backend="aot_eager")(x)
