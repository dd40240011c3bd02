"""GPU only, one GPU: the expert-parallel path in a one-rank NCCL group, through both transports
(NCCL all-to-all and the symmetric-memory pull), against the single-process experts function,
bitwise. EP sizes above one are tests/test_parallel_multi_gpu.py (two GPUs or more)."""

import os

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from mok_plugin import ops  # noqa: E402
from mok_plugin.parallel import moe_experts_expert_parallel  # noqa: E402
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule  # noqa: E402
from mok_plugin.testing import free_port  # noqa: E402


@pytest.fixture(scope="module")
def one_rank_group():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["nccl", "symmetric_memory"])
def test_one_rank_expert_parallel_matches_single_process(one_rank_group, transport):
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, I, E, K = 512, 1024, 512, 16, 4
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    ids = torch.multinomial(torch.ones(T, E, device="cuda"), K, generator=g)
    w = torch.rand(T, K, device="cuda", generator=g).requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    probe = torch.randn(T, H, device="cuda", generator=g)
    results = []
    for run in ("single", "ep"):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]
        if run == "single":
            out = ops.moe_experts(*leaves, build_schedule(ids, E, tile_m=DEFAULT_TILE_M))
        else:
            out, _ = moe_experts_expert_parallel(*leaves[:1], ids, *leaves[1:], ops.moe_experts, one_rank_group, E,
                                                 DEFAULT_TILE_M, capacity_factor=1.0, transport=transport)  # fmt: skip
        (out.float() * probe).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(["out", "d_x", "d_w", "d_w13", "d_w2"], *results, strict=True):
        assert torch.equal(a, b), f"{name} differs ({transport})"


@pytest.mark.parametrize("exchange", ["exact", "nccl", "symmetric_memory"])
def test_one_rank_expert_parallel_with_no_tokens(one_rank_group, exchange):
    # A rank with no tokens still joins every exchange; its output is empty and the expert
    # gradients exactly zero (bf16, the triton backend).
    H, I, E, K = 1024, 512, 16, 4
    x = torch.empty(0, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ids = torch.empty(0, K, dtype=torch.int64, device="cuda")
    w = torch.empty(0, K, device="cuda").requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, device="cuda") / 32).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda") / 32).bfloat16().requires_grad_()
    capacity = None if exchange == "exact" else 1.0
    transport = "nccl" if exchange == "exact" else exchange
    out, dropped = moe_experts_expert_parallel(
        x, ids, w, w13, w2, ops.moe_experts, one_rank_group, E, DEFAULT_TILE_M, capacity_factor=capacity,
        transport=transport,
    )  # fmt: skip
    out.float().sum().backward()
    assert out.shape == (0, H) and int(dropped) == 0
    assert not w13.grad.any() and not w2.grad.any(), f"expert gradients of no tokens are not zero ({exchange})"
