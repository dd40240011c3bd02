"""FLOPs of a routed-expert pass, by SonicMoE's convention (so numbers compare; BENCHMARKS.md, Method).

Only the expert GEMMs count: 2 FLOPs per multiply-add, forward 2 x T K x the family's multiply-adds
per row (`MoKExpertFamily.gemm_macs_per_row`: 3HI for a GLU expert, 2HI for a plain MLP, H^2 for a
linear expert), backward twice the forward (the input and the weight gradients). So per pass, in
units of T*K*H*I: GLU 6 / 12 / 18, plain MLP 4 / 8 / 12. The activation, the bias adds, the router
and data movement are left out of the count and included in the time.
"""

from __future__ import annotations

from mok_plugin.experts import SWIGLU, MoKExpertFamily
from mok_plugin.testing import MoEShape

__all__ = ["moe_flops"]

# Multiples of the forward GEMMs' FLOPs per pass.
_PER_PASS = {"forward": 1, "backward": 2, "fwd+bwd": 3}


def moe_flops(shape: MoEShape, pass_name: str, family: MoKExpertFamily = SWIGLU) -> float:
    """FLOPs of the routed experts' GEMMs in one pass.

    Args:
        shape: (T, H, I, E, K).
        pass_name: "forward", "backward" or "fwd+bwd".
        family: what each expert computes (SwiGLU: 6/12/18 T*K*H*I; a plain MLP: 4/8/12).
    Returns:
        The FLOP count (a float: the products pass 2**53 only far beyond any real shape).
    Raises:
        KeyError: an unknown pass name.
    """
    forward = 2.0 * shape.T * shape.K * family.gemm_macs_per_row(shape.H, shape.I)
    return _PER_PASS[pass_name] * forward
