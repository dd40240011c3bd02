"""Triton kernels of the MoK layer, one file per kernel family; no autograd, no torch.library.
Under Triton's CPU interpreter, its dot is made independent of a row's position first (interpreter.py)."""

from mok_plugin.kernels.configs import interpreter_on

if interpreter_on():
    from mok_plugin.kernels.interpreter import dot_independent_of_row_position

    dot_independent_of_row_position()
