"""Triton's CPU interpreter (TRITON_INTERPRET=1, how the tests run the kernels without a GPU) with a
`tl.dot` whose rows do not depend on their neighbours.

The interpreter computes `tl.dot` with numpy's matmul in the operands' precision. Numpy's float32
and float16 matmul (its BLAS) gives a row a result that depends on the row's position in the tile
on some CPUs (seen with numpy 2.4 and 2.5 on this project's CI machines: rolling a 32-row tile by
one row changed results by 6e-6). On the GPU a row's sum never depends on the other rows, and MoK's
batch- and topology-invariance tests rest on that. So, under the interpreter, floating-point dots
are summed in float64 (every product of fp32 or narrower values exact, the sum's order within
1e-16) and rounded once to the accumulator's dtype: the same result wherever the row sits.
"""

from __future__ import annotations

__all__ = ["dot_independent_of_row_position"]


def dot_independent_of_row_position() -> None:
    """Patch the interpreter's dot as the module docstring says (once per process; bf16 and integer
    dots are left to the interpreter)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_mok_row_independent_dot", False):
        return
    original = builder.create_dot

    def widened(handle) -> np.ndarray | None:
        scalar = handle.dtype.scalar
        if scalar in (tl.float32, tl.float16):
            return handle.data.astype(np.float64)
        if scalar.is_floating() and scalar.primitive_bitwidth == 8:  # as the interpreter reads FP8
            return interpreter._convert_float(handle.data, scalar, tl.float16, None).view(np.float16).astype(np.float64)
        return None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_wide, b_wide = widened(a), widened(b)
        if a_wide is None or b_wide is None or not np.issubdtype(d.data.dtype, np.floating):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a_wide, b_wide).astype(d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    builder._mok_row_independent_dot = True
