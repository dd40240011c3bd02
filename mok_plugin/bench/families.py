"""The expert families the benchmarks take by name (`mok bench layer --expert NAME ...`).

Each name is one `MoKExpertFamily` (mok_plugin/experts.py has the formulas):
  swiglu         bias-free SwiGLU (glu, silu): Qwen3, DeepSeek, Mixtral, OLMoE, Kimi, GLM
  swiglu-bias    SwiGLU with biases on both linears
  gpt-oss        GPT-OSS's MLP: glu with quick_gelu x*sigmoid(1.702x), the gate clamped above at 7.0
                 and the linear half to [-7, 7], linear offset 1.0, biases on both linears
                 (openai/gpt-oss, gpt_oss/torch/model.py)
  nemotron       Nemotron's MLP: not gated, squared ReLU, no bias (the same as mlp-squared-relu)
  glu-ACT        a gated expert with activation ACT (glu-gelu is GeGLU, glu-relu ReGLU)
  mlp-ACT        a plain two-linear MLP with activation ACT
  linear         one H x H linear per expert, no activation (needs I = H)
where ACT is an activation of experts.ACTIVATIONS with "-" for "_": silu (mlp only; glu-silu is
swiglu), gelu, gelu-tanh, quick-gelu, relu, squared-relu.
"""

from __future__ import annotations

from mok_plugin.experts import ACTIVATIONS, SWIGLU, MoKExpertFamily
from mok_plugin.testing import MoEShape

__all__ = ["EXPERT_FAMILIES", "expert_family", "shapes_it_cannot_take"]


def _table() -> dict[str, MoKExpertFamily]:
    table = {
        "swiglu": SWIGLU,
        "swiglu-bias": MoKExpertFamily(fc1_bias=True, fc2_bias=True),
        "gpt-oss": MoKExpertFamily("glu", "quick_gelu", clamp=7.0, linear_offset=1.0, fc1_bias=True, fc2_bias=True),
        "nemotron": MoKExpertFamily("mlp", "squared_relu"),
    }
    for kind in ("glu", "mlp"):
        for activation in ACTIVATIONS:
            if (kind, activation) != ("glu", "silu"):
                table[f"{kind}-{activation.replace('_', '-')}"] = MoKExpertFamily(kind, activation)
    table["linear"] = MoKExpertFamily("linear")
    return table


EXPERT_FAMILIES: dict[str, MoKExpertFamily] = _table()


def expert_family(name: str) -> MoKExpertFamily:
    """The family of a benchmark name.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    try:
        return EXPERT_FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown expert family {name[:80]!r}; known: {', '.join(EXPERT_FAMILIES)}") from None


def shapes_it_cannot_take(name: str, shapes: list[tuple[str, MoEShape]]) -> str | None:
    """Why family `name` cannot run on some of these (label, shape) pairs, as the commands print it;
    None if it can run on all: a linear expert is one H x H linear, so it needs I = H."""
    if EXPERT_FAMILIES[name].kind != "linear":
        return None
    not_square = [text for text, shape in shapes if shape.I != shape.H]
    if not not_square:
        return None
    return f"--expert {name}: one H x H linear per expert needs I = H; not in {', '.join(not_square)}"
