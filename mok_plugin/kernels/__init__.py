"""Triton kernels of the MoK layer, one file per kernel family; no autograd, no torch.library."""
