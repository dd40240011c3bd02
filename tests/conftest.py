"""Without a GPU, Triton kernels run in Triton's CPU interpreter: the switch must be set before
any kernel module is imported, so it is set here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
