"""The persistent megakernel (kernels/megakernel.py) against the reference backend at small shapes
(the crafted cases of triton_cases.py), with capacity drops, and against the multi-kernel variant.

Without CUDA the CPU interpreter runs the whole task list in its first program (no waits can
block); with CUDA the same tests run compiled over every SM, the readiness counters ordering the
tasks.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import CASES, DTYPES, GRADIENT_NAMES, compare_with_reference  # noqa: E402

from mok_plugin.testing import assert_close  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, I, E, K, kind, capacity", CASES)
def test_megakernel_matches_reference(T, H, I, E, K, kind, capacity, dtype):
    compare_with_reference(T, H, I, E, K, kind, dtype, capacity=capacity, variant="megakernel")


@pytest.mark.slow
def test_megakernel_equals_multi_kernel():
    # Both variants run the same tile functions with the same tile shapes: the output, dx and the
    # weight gradients are the same bits. The router gradient sums per-I-block partials whose
    # blocks differ (the megakernel's fused down-dgrad tile vs the multi-kernel epilogue kernel's
    # block; equal under the interpreter's tiles), so it is compared to fp32 rounding.
    mega = compare_with_reference(90, 48, 40, 5, 2, "skewed", torch.float32, seed=4, variant="megakernel")
    multi = compare_with_reference(90, 48, 40, 5, 2, "skewed", torch.float32, seed=4, variant="multi_kernel")
    for name, a, b in zip(GRADIENT_NAMES, mega, multi, strict=True):
        if name == "d_topk_weights":
            assert_close(a, b, torch.float32, name, n_reduce=40)
        else:
            assert torch.equal(a, b), name
