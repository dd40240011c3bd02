"""The FP8 dense GEMM ceiling's operands: the scaled matmul it times must compute the blockwise
product MoK's FP8 computes (A scaled per 1 x 128, B per 128 x 128), else its rate means nothing."""

import pytest
import torch

from mok_plugin.bench import ceiling

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the scaled matmul needs a CUDA GPU")


def _dequantised_product(a, b, scales, blockwise):
    K = a.shape[1]
    scale_a, scale_b = scales
    if blockwise:
        scale_a = scale_a.repeat_interleave(128, dim=1)  # [M, K]
        scale_b = scale_b[: K // 128].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)  # [K, N]
    return (a.double() * scale_a.double()) @ (b.double() * scale_b.double())


@needs_cuda
@pytest.mark.parametrize("blockwise", [True, False])
def test_the_timed_fp8_gemm_computes_the_scaled_product(blockwise):
    torch.manual_seed(0)
    a, b, scales = ceiling._scaled_operands(256, 640, 384, blockwise)
    try:
        got = ceiling._scaled_matmul(a, b, scales, blockwise)
    except (ImportError, RuntimeError, NotImplementedError) as error:
        pytest.skip(f"no such FP8 GEMM on this GPU and torch: {error}")
    want = _dequantised_product(a, b, scales, blockwise)
    assert got.dtype == torch.bfloat16 and got.shape == (256, 384)
    # bf16 output (2^-8 relative) and, with fast accumulation, FP8's reduced-precision sums
    assert (got.double() - want).norm() / want.norm() < 1e-2
    assert torch.equal(got, ceiling._scaled_matmul(a, b, scales, blockwise))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="rates asserted on Hopper"
)
def test_dense_fp8_gemm_rates_on_hopper():
    # both GEMMs exist on sm_90 with torch's CUDA 13 build (blockwise from cuBLASLt 12.9): not None
    blockwise, per_tensor = (ceiling.dense_fp8_gemm_tflops(b, iters=5, settle_s=0.0) for b in (True, False))
    assert blockwise > 0 and per_tensor > 0


def test_a_gpu_without_the_fp8_gemm_gives_no_rate_and_says_why(monkeypatch):
    # an older torch or GPU (blockwise needs sm_90 and cuBLASLt 12.9): None and a warning naming the
    # error, so the bench reports the rate as not measured instead of failing
    def no_such_gemm(*args):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(ceiling, "_scaled_operands", lambda *args: (None, None, None))
    monkeypatch.setattr(ceiling, "_scaled_matmul", no_such_gemm)
    with pytest.warns(UserWarning, match="no blockwise FP8 GEMM here: Invalid scaling configuration"):
        assert ceiling.dense_fp8_gemm_tflops(blockwise=True) is None
