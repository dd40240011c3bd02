"""Without a GPU, Triton kernels run in Triton's CPU interpreter: the switch must be set before
any kernel module is imported, so it is set here, first.

DeepSpeed worlds started in the test process itself use gloo's all-reduce, not DeepSpeed's CPU
shared-memory op (mok_plugin.deepspeed.cpu_comm says why: it leaked /dev/shm until the machine ran
out of memory); spawned ranks get the same through mok_plugin.testing.run_ranks.

`nccl_world`: a one-rank NCCL world with Megatron's parallel state, for the GPU tests of Megatron's
distributed optimizer and CUDA graphs."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _deepspeed_without_shared_memory_allreduce():
    # After collection: the test modules that use DeepSpeed have imported it by now.
    if "deepspeed" in sys.modules:
        from mok_plugin.deepspeed.cpu_comm import skip_shared_memory_allreduce

        skip_shared_memory_allreduce()
    yield


@pytest.fixture()
def nccl_world():
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from mok_plugin.testing import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
