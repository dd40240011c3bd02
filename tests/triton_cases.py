"""Shared by the kernel and op tests (not a test module): crafted routings and the comparison of
the triton backend against the reference backend on one schedule, forward and every gradient.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
in fp32 and fp16: the interpreter's bf16 tl.dot is unreliable. With CUDA the same cases run compiled.
"""

import functools

import pytest
import torch

from mok_plugin import ops
from mok_plugin.reference import moe_experts_reference
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule
from mok_plugin.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
GRADIENT_NAMES = ["output", "d_x", "d_topk_weights", "d_gate_up_proj", "d_down_proj"]

# (T, H, I, E, K, routing, capacity) every kernel variant is checked at, each with why it exists.
CASES = [
    pytest.param(40, 64, 32, 4, 2, "uniform", None, id="uniform"),
    pytest.param(1, 64, 32, 4, 2, "uniform", None, id="T1"),  # a single token: most experts empty
    pytest.param(50, 40, 24, 6, 3, "uniform", None, id="H_I_not_block_multiples"),  # masks on every edge
    pytest.param(60, 32, 32, 5, 2, "one_expert", None, id="all_first_choices_on_one_expert"),
    pytest.param(70, 32, 16, 8, 2, "skewed", None, id="skewed_with_empty_experts"),
    pytest.param(130, 32, 16, 3, 1, "uniform", None, id="segment_spans_two_tiles"),  # > DEFAULT_TILE_M rows/expert
    pytest.param(4, 256, 32, 4, 2, "uniform", None, id="rows_fewer_than_E_times_H"),  # wide H: no config narrows
    pytest.param(48, 32, 16, 4, 2, "one_expert", 20, id="capacity_drops"),  # expert 3's 48 rows cut to 20
]


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


def _run(fn, x, w, w13, w2, schedule, probe):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
    out = fn(*leaves, schedule)
    (out.float() * probe).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def compare_with_reference(T, H, I, E, K, kind, dtype, seed=0, capacity=None, variant="megakernel"):
    """Output and every gradient of `variant` against the reference backend (to the dtype's bound)
    and against a second run of itself (bitwise). Returns the first run's tensors."""
    g = torch.Generator().manual_seed(seed)
    ids = crafted_routing(T, E, K, kind, g).to(DEVICE)
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
    reduce = [1, 2 * I, H, rows, rows]
    for name, a, b, n in zip(GRADIENT_NAMES, got, want, reduce, strict=True):
        assert_close(a, b, dtype, name, n_reduce=n)
    again = _run(triton_fn, x, w, w13, w2, schedule, probe)
    for name, a, b in zip(GRADIENT_NAMES, got, again, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"
    return got
