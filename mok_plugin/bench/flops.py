"""FLOPs of a routed-expert pass, by SonicMoE's convention (so numbers compare; BENCHMARKS.md, Method).

Router and data movement are left out of the count and included in the time.
"""

from __future__ import annotations

from mok_plugin.testing import MoEShape

__all__ = ["moe_flops"]

# Multiples of T*K*H*I per pass: a gated (GLU) expert has three H x I matrices, a plain MLP two.
_PER_PASS = {
    True: {"forward": 6, "backward": 12, "fwd+bwd": 18},
    False: {"forward": 4, "backward": 8, "fwd+bwd": 12},
}


def moe_flops(shape: MoEShape, pass_name: str, gated: bool = True) -> float:
    """FLOPs of the routed experts in one pass.

    Args:
        shape: (T, H, I, E, K).
        pass_name: "forward", "backward" or "fwd+bwd".
        gated: a GLU expert (SwiGLU: 6/12/18 T*K*H*I) or a plain two-linear MLP (4/8/12).
    Returns:
        The FLOP count (a float: the products pass 2**53 only far beyond any real shape).
    Raises:
        KeyError: an unknown pass name.
    """
    return _PER_PASS[gated][pass_name] * shape.T * shape.K * shape.H * shape.I
