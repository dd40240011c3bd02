"""Under Triton's CPU interpreter, tl.dot gives a row the same result wherever it sits in the tile
(mok_plugin/kernels/interpreter.py), as the GPU's MMA does: the batch- and topology-invariance tests
of the kernels rest on it."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mok_plugin.kernels.configs import interpreter_on  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="about Triton's CPU interpreter (no GPU here)")


@triton.jit
def _tile_dot(a_ptr, b_ptr, c_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, ks, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_N)
    a = tl.load(a_ptr + rows[:, None] * BLOCK_K + ks[None, :])
    b = tl.load(b_ptr + ks[:, None] * BLOCK_N + cols[None, :])
    tl.store(c_ptr + rows[:, None] * BLOCK_N + cols[None, :], tl.dot(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rows_dot_does_not_depend_on_its_place_in_the_tile(dtype):
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(32, 64, generator=generator).to(dtype)
    b = torch.randn(64, 32, generator=generator).to(dtype)
    out = torch.empty(32, 32)
    _tile_dot[(1,)](a, b, out, 32, 64, 32)
    assert (out - a.double() @ b.double()).abs().max() < 1e-5  # a dot, to fp32's rounding
    for shift in (1, 3, 7, 16):
        rolled = torch.empty(32, 32)
        _tile_dot[(1,)](a.roll(shift, 0).contiguous(), b, rolled, 32, 64, 32)
        assert torch.equal(rolled.roll(-shift, 0), out), f"rows moved by {shift} changed"
