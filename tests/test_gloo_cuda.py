"""mok_plugin.parallel.gloo_cuda: gloo ranks sharing a GPU reduce their gradients one collective at
a time; the sums must be those of the coalesced path. Checked on CPU tensors over gloo (the CUDA
case runs on the H200 in DeepSpeed's upstream tests and `mok bench ep-overlap`)."""

import sys
import types

import torch
import torch.distributed as dist

from mok_plugin.testing import init_gloo, run_ranks


def _rank(rank: int, world: int, port: int) -> None:
    init_gloo(rank, world, port)
    from mok_plugin.parallel import gloo_cuda

    # A module that imported the context manager by name, as Megatron's param_and_grad_buffer does.
    importer = types.ModuleType("imports_coalescing_manager_by_name")
    importer._coalescing_manager = dist._coalescing_manager
    sys.modules[importer.__name__] = importer
    gloo_cuda.run_collectives_one_by_one()
    assert importer._coalescing_manager is dist._coalescing_manager is gloo_cuda._one_by_one

    gen = torch.Generator().manual_seed(7)
    parts = [torch.randn(world, 5, generator=gen), torch.randn(world, 3, generator=gen)]
    mine = [p[rank].clone() for p in parts]
    with dist.distributed_c10d._coalescing_manager(dist.group.WORLD, async_ops=False) as cm:
        for t in mine:
            dist.all_reduce(t)
    cm.wait()
    theirs = [p[rank].clone() for p in parts]
    dist.all_reduce_coalesced(theirs)
    for t, u, p in zip(mine, theirs, parts, strict=True):
        expected = p[0].clone()
        for r in range(1, world):
            expected += p[r]
        torch.testing.assert_close(t, expected)
        assert torch.equal(t, u)
    dist.destroy_process_group()


def test_collectives_one_by_one_give_the_coalesced_sums():
    run_ranks(_rank, 2, timeout_s=120)
