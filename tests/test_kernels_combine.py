"""The fixed-order sums back into token order (kernels/combine.py): combine_rows (each token's K
rows summed in ascending k, fp32, rounded once; dropped pairs add nothing) and reduce_router_grad
(each pair's I-block partials summed in ascending order), against plain PyTorch in the same order,
bitwise; and zero tokens."""

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from triton_cases import DEVICE, DTYPES  # noqa: E402

from mok_plugin.kernels.combine import combine_rows, reduce_router_grad  # noqa: E402


def _tk_to_row(T: int, K: int, num_rows: int, drop_every: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.randperm(num_rows, generator=g)[: T * K]
    rows[::drop_every] = -1  # pairs dropped by capacity
    return rows.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, K", [(1, 40, 1), (37, 72, 3), (20, 300, 8)])
def test_combine_rows_sums_k_in_order(T, H, K, dtype):
    g = torch.Generator().manual_seed(T + H)
    num_rows = T * K + 17
    rows = torch.randn(num_rows, H, generator=g).to(DEVICE, dtype)
    tk_to_row = _tk_to_row(T, K, num_rows, 5, g)
    got = combine_rows(rows, tk_to_row, T, K)
    want = torch.zeros(T, H, dtype=torch.float32, device=DEVICE)
    picked = tk_to_row.view(T, K)
    for k in range(K):  # ascending k in fp32, as the kernel adds
        ok = picked[:, k] >= 0
        want += torch.where(ok[:, None], rows[picked[:, k].clamp(min=0)].float(), 0.0)
    assert torch.equal(got, want.to(dtype))
    assert torch.equal(combine_rows(rows, tk_to_row, T, K), got)


def test_reduce_router_grad_sums_blocks_in_order():
    g = torch.Generator().manual_seed(3)
    T, K, J, num_rows = 30, 4, 5, 150
    partial = torch.randn(num_rows, J, generator=g).to(DEVICE)
    tk_to_row = _tk_to_row(T, K, num_rows, 7, g)
    got = reduce_router_grad(partial, tk_to_row, T, K)
    want = torch.zeros(T * K, dtype=torch.float32, device=DEVICE)
    ok = tk_to_row >= 0
    for j in range(J):
        want += torch.where(ok, partial[tk_to_row.clamp(min=0), j], 0.0)
    assert torch.equal(got, want.view(T, K))


def test_zero_tokens_and_bad_maps():
    rows = torch.randn(16, 8).to(DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert combine_rows(rows, empty, 0, 2).shape == (0, 8)
    assert reduce_router_grad(torch.randn(16, 3).to(DEVICE), empty, 0, 2).shape == (0, 2)
    with pytest.raises(ValueError, match="tk_to_row must be int64 \\[6\\]"):
        combine_rows(rows, torch.zeros(6, dtype=torch.int32, device=DEVICE), 3, 2)
    with pytest.raises(ValueError, match="partial must be a contiguous fp32"):
        reduce_router_grad(torch.randn(16, 3).to(DEVICE).half(), empty, 0, 2)
