"""Shared by the kernel and op tests (not a test module): crafted routings and the comparison of
the triton backend against the reference backend on one schedule, forward and every gradient.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
in fp32 and fp16: the interpreter's bf16 tl.dot is unreliable. With CUDA the same cases run compiled.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mok_plugin import ops
from mok_plugin.experts import SWIGLU
from mok_plugin.reference import moe_experts_reference
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule
from mok_plugin.testing import assert_close, oracle_experts, oracle_kept_pairs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 (Hopper) GPU")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
GRADIENT_NAMES = ["output", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]  # of a SwiGLU expert

# (T, H, I, E, K, routing, capacity) every kernel variant is checked at, each with why it exists.
CASES = [
    pytest.param(40, 64, 32, 4, 2, "uniform", None, id="uniform"),
    pytest.param(1, 64, 32, 4, 2, "uniform", None, id="T1"),  # a single token: most experts empty
    pytest.param(50, 40, 24, 6, 3, "uniform", None, id="H_I_not_block_multiples"),  # masks on every edge; ALIGN 8
    pytest.param(20, 36, 20, 4, 2, "uniform", None, id="H_I_multiples_of_4_only"),  # ALIGN 4 (launch.alignment)
    pytest.param(60, 32, 32, 5, 2, "one_expert", None, id="all_first_choices_on_one_expert"),
    pytest.param(70, 32, 16, 8, 2, "skewed", None, id="skewed_with_empty_experts"),
    pytest.param(130, 32, 16, 3, 1, "uniform", None, id="segment_spans_two_tiles"),  # > DEFAULT_TILE_M rows/expert
    pytest.param(4, 256, 32, 4, 2, "uniform", None, id="rows_fewer_than_E_times_H"),  # wide H: no config narrows
    pytest.param(48, 32, 16, 4, 2, "one_expert", 20, id="capacity_drops"),  # expert 3's 48 rows cut to 20
]


ROOT = Path(__file__).resolve().parents[1]


def outside_the_interpreter(*python_args: str, timeout: int = 300, cwd: Path = ROOT) -> str:
    """The stdout of `python *python_args` (e.g. "-c", code) run from `cwd` (the repository; a copy of
    the package imports that copy) in a process of its own without TRITON_INTERPRET, which this test
    session sets: how the tests compile kernels for sm_90 on a machine without a GPU. Fails the test
    with the process's stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, *python_args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


# Each K step's wgmma per warpgroup of the bf16 Gluon kernels (wgrad_hopper, rows_hopper) on operands in
# shared memory: the cooperative schedule's two warpgroups each 64 rows of a 128 x 256 tile (4 of
# m64n256k16 in one function); each ping-pong warpgroup a whole 128 x 128 tile (8 of m64n128k16 in each
# of its two functions).
WGMMA_PER_STEP = {"cooperative": ("m64n256k16", 4), "pingpong": ("m64n128k16", 16)}


def gluon_sm90_report(compile_call: str, wgmma_shape: str) -> tuple[int, int, int, int]:
    """(shared memory bytes, registers, stack bytes per thread, wgmma instructions of `wgmma_shape`, e.g.
    "m64n256k16") of the Gluon kernel `compile_call` returns, a call of mok_plugin.bench.inspect's (e.g.
    "compile_wgrad_hopper('pingpong')"), compiled for sm_90 outside the interpreter."""
    code = (
        "from mok_plugin.bench import inspect\n"
        f"k = inspect.{compile_call}\n"
        f"wgmma = k.asm['ptx'].count('wgmma.mma_async.sync.aligned.{wgmma_shape}')\n"
        "print(k.metadata.shared, *inspect.resource_usage(k.asm['cubin']), wgmma)\n"
    )
    shared, registers, stack, wgmma = map(int, outside_the_interpreter("-c", code).split()[-4:])
    return shared, registers, stack, wgmma


def crafted_routing(T: int, E: int, K: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """int64 [T, K] expert ids: 'uniform', 'one_expert' (every first choice on E-1) or 'skewed'."""
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


def _run(fn, x, w, weights, schedule, probe, **kw):
    """Output and the gradients of x, w and every weight that is not None (in that order)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
    weight_leaves = {k: None if t is None else t.detach().clone().requires_grad_() for k, t in weights.items()}
    out = fn(*leaves, weight_leaves["gate_up_proj"], weight_leaves["down_proj"], schedule, **kw,
             gate_up_bias=weight_leaves["gate_up_bias"], down_bias=weight_leaves["down_bias"])  # fmt: skip
    (out.float() * probe).sum().backward()
    return [out.detach()] + [t.grad for t in leaves] + [t.grad for t in weight_leaves.values() if t is not None]


def family_weights(E, H, I, family, generator, device, dtype):
    """gate_up_proj, down_proj and the family's biases, fresh random (biases included), scaled so
    that h and the output stay near unit size."""

    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=generator) / fan_in**0.5).to(device, dtype)

    n1 = family.fc1_width(I)
    inner = family.intermediate_size(H, I)
    return {
        "gate_up_proj": rand(E, n1, H, fan_in=H) if family.kind != "linear" else None,
        "down_proj": rand(E, H, inner, fan_in=inner),
        "gate_up_bias": rand(E, n1, fan_in=4) if family.fc1_bias else None,
        "down_bias": rand(E, H, fan_in=4) if family.fc2_bias else None,
    }


def compare_with_reference(
    T, H, I, E, K, kind, dtype, seed=0, capacity=None, variant="megakernel", family=SWIGLU, oracle=False
):
    """Output and every gradient of `variant` against the reference backend (to the dtype's bound)
    and against a second run of itself (bitwise); with `oracle`, also against the float64 per-token
    oracle (testing.oracle_experts, written from the definitions). Returns the first run's tensors:
    output, d_x, d_topk_weights, then the gradients of the weights and biases the family has."""
    g = torch.Generator().manual_seed(seed)
    ids = crafted_routing(T, E, K, kind, g).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w = torch.rand(T, K, generator=g).to(DEVICE)
    weights = family_weights(E, H, I, family, g, DEVICE, dtype)
    probe = torch.randn(T, H, generator=g).to(DEVICE)
    schedule = build_schedule(ids, E, tile_m=DEFAULT_TILE_M, capacity=capacity)
    triton_fn = functools.partial(ops.moe_experts, variant=variant, family=family)
    got = _run(triton_fn, x, w, weights, schedule, probe)
    want = _run(functools.partial(moe_experts_reference, family=family), x, w, weights, schedule, probe)
    names = ["output", "d_x", "d_topk_weights"] + [f"d_{k}" for k, t in weights.items() if t is not None]
    rows = max(1, T * K // E)
    inner = family.intermediate_size(H, I)
    reduce = {"output": 1, "d_x": max(family.fc1_width(I), inner), "d_topk_weights": max(H, inner)}
    for name, a, b in zip(names, got, want, strict=True):
        assert_close(a, b, dtype, name, n_reduce=reduce.get(name, rows))
    if oracle:
        kept = oracle_kept_pairs(ids.cpu(), E, capacity)
        oracle_fn = functools.partial(_oracle_on_cpu, ids=ids.cpu(), kept=kept, family=family)
        weights64 = {k: None if t is None else t.double() for k, t in weights.items()}
        oracle_out = _run(oracle_fn, x.double(), w.double(), weights64, schedule, probe.double())
        for name, a, b in zip(names, got, oracle_out, strict=True):
            assert_close(a, b.to(a.device), dtype, f"{name} vs float64 oracle", n_reduce=reduce.get(name, rows))
    again = _run(triton_fn, x, w, weights, schedule, probe)
    for name, a, b in zip(names, got, again, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"
    return got


def _oracle_on_cpu(x, w, gate_up_proj, down_proj, schedule, *, ids, kept, family, gate_up_bias, down_bias):
    def cpu(t):
        return None if t is None else t.cpu()

    out = oracle_experts(cpu(x), ids, cpu(w), cpu(gate_up_proj), cpu(down_proj), kept, family, cpu(gate_up_bias),
                         cpu(down_bias))  # fmt: skip
    return out.to(x.device)
