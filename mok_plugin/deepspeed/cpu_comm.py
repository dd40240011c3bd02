"""DeepSpeed on the CPU without its shared-memory all-reduce, for MoK's own tools and tests.

DeepSpeed's CPU accelerator builds a C++ op (`deepspeed_shm_comm`) the first time a world starts
(a JIT compile: minutes on a small machine) and each world then leaves a 69 MB buffer per rank in
/dev/shm that nothing removes. /dev/shm is memory: a test suite that starts a few hundred DeepSpeed
worlds filled a 24 GiB machine and was killed. torch.distributed's gloo all-reduce does the same
job; this module keeps DeepSpeed on it. It changes nothing on CUDA, where the op does not exist,
and is never applied to a user's own DeepSpeed launch (importing mok_plugin.deepspeed leaves it)."""

SHM_OP_NAME = "deepspeed_shm_comm"


def skip_shared_memory_allreduce() -> None:
    """Make DeepSpeed's CPU backend treat its shared-memory op as unavailable (it then uses gloo).
    Call before deepspeed.init_distributed or deepspeed.initialize starts a world."""
    import deepspeed.ops

    # build_shm_op() returns None for an op listed here as incompatible; the dict is built on
    # first access and kept as the module's global, so the entry stays for this process.
    deepspeed.ops.__compatible_ops__[SHM_OP_NAME] = False
