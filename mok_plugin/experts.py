"""The expert families: what one routed expert computes, as data, and its float64 math.

Owns: `MoKExpertFamily` (kind, activation, GPT-OSS clamp and linear offset, which linears carry a
bias), the activation names (`ACTIVATIONS`), `fc1_width` (rows of the first linear), and the
float64 activation forward and backward that the reference backend and the tests use.

The kinds, per expert e over its input row x (H), with b1/b2 the optional biases:
    glu     h = x W1_e^T + b1 [2I], gate first; A = act(min(gate, c)) * (clamp(up, -c, c) + offset)
            (c, the clamp, only when set: GPT-OSS; offset defaults to 0). SwiGLU is glu with silu.
    mlp     h = x W1_e^T + b1 [I]; A = act(h)
    linear  one linear, no activation: A = x, I = H
and then, for every kind, y = w * (A W2_e^T + b2): the routing weight w scales the whole expert
output, the second bias included, as Megatron's experts (`_apply_bias` adds b2 * probs) and
DeepSpeed's combine (the gate times the expert's output) both do. For `linear`, W2 is the one
linear [E, H, H] and there is no W1.

The activations are the framework's formulas: silu x*sigmoid(x); gelu the erf GELU; gelu_tanh the
tanh approximation; quick_gelu x*sigmoid(1.702x) (Megatron, GPT-OSS); relu; squared_relu relu(x)^2
(Nemotron). Their derivatives are autograd's (relu' = 0 at 0; a clamp passes the gradient where the
input lies inside the closed range, as torch.clamp does).

Does not own: where the rows come from (schedule), the kernels' fp32 copies of these formulas
(kernels/tiles.py), or how the adapters recognise a family (megatron/, deepspeed/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS",
    "EXPERT_KINDS",
    "MoKExpertFamily",
    "SWIGLU",
    "activation",
    "activation_fp64",
    "activation_backward_fp64",
    "check_expert_weights",
    "family_field_problems",
    "FAMILY_FIELDS",
]

Activation = Literal["silu", "gelu", "gelu_tanh", "quick_gelu", "relu", "squared_relu"]
ExpertKind = Literal["glu", "mlp", "linear"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
EXPERT_KINDS: tuple[str, ...] = get_args(ExpertKind)
# quick_gelu's slope (Megatron's `quick_gelu`, OpenAI's GPT-OSS).
QUICK_GELU_ALPHA = 1.702


@dataclass(frozen=True, slots=True)
class MoKExpertFamily:
    """What a routed (and shared) expert computes; see the module docstring for the formulas.

    Fields:
        kind: "glu" (gated, fc1 has 2I rows, gate first), "mlp" (fc1 has I rows) or "linear"
            (one H x H linear, no activation, no fc1).
        activation: one of ACTIVATIONS; not read for "linear".
        clamp: glu only: the gate is clamped above at clamp, the linear half to [-clamp, clamp].
        linear_offset: glu only: added to the (clamped) linear half.
        fc1_bias / fc2_bias: whether the first / second linear has a bias ([E, fc1 rows] / [E, H]).
    """

    kind: ExpertKind = "glu"
    activation: Activation = "silu"
    clamp: float | None = None
    linear_offset: float = 0.0
    fc1_bias: bool = False
    fc2_bias: bool = False

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind {self.kind!r}; allowed: {', '.join(EXPERT_KINDS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r}; allowed: {', '.join(ACTIVATIONS)}")
        if self.kind != "glu" and (self.clamp is not None or self.linear_offset != 0.0):
            raise ValueError(f"an activation clamp and a linear offset apply to glu experts only, not {self.kind!r}")
        if self.clamp is not None and not (math.isfinite(self.clamp) and self.clamp > 0):
            raise ValueError(f"expert activation clamp={self.clamp!r}; allowed: a finite value > 0")
        if not math.isfinite(self.linear_offset):
            raise ValueError(f"glu linear offset={self.linear_offset!r}; allowed: a finite value")
        if self.kind == "linear" and self.fc1_bias:
            raise ValueError("a linear expert has no first linear, so no fc1 bias (its bias is fc2_bias)")

    @property
    def is_swiglu(self) -> bool:
        """Bias-free SwiGLU without clamp or offset: what the megakernel computes."""
        return self == SWIGLU

    @property
    def gated(self) -> bool:
        return self.kind == "glu"

    def fc1_width(self, ffn_hidden_size: int) -> int:
        """Rows of the first linear (and columns of h): 2I for glu, I for mlp, 0 for linear."""
        return {"glu": 2 * ffn_hidden_size, "mlp": ffn_hidden_size, "linear": 0}[self.kind]

    def intermediate_size(self, hidden_size: int, ffn_hidden_size: int) -> int:
        """Columns of A (the second linear's input): I, or H for a linear expert."""
        return hidden_size if self.kind == "linear" else ffn_hidden_size

    def gemm_macs_per_row(self, hidden_size: int, ffn_hidden_size: int) -> int:
        """Multiply-adds of one row's forward GEMMs (FLOPs are twice this): (fc1 rows + H) x I-ish."""
        H, I = hidden_size, ffn_hidden_size
        return {"glu": 3 * H * I, "mlp": 2 * H * I, "linear": H * H}[self.kind]

    def config_fields(self) -> dict[str, object]:
        """The MoKConfig fields that select this family (MoKConfig.expert_family is the inverse)."""
        return dict(
            expert_kind=self.kind,
            expert_activation=self.activation,
            activation_clamp=self.clamp,
            glu_linear_offset=self.linear_offset,
            expert_fc1_bias=self.fc1_bias,
            expert_fc2_bias=self.fc2_bias,
        )

    @classmethod
    def from_config_fields(cls, fields: dict[str, object]) -> MoKExpertFamily:
        """The family of MoKConfig-named fields (the inverse of `config_fields`)."""
        return cls(
            kind=fields["expert_kind"],
            activation=fields["expert_activation"],
            clamp=fields["activation_clamp"],
            linear_offset=fields["glu_linear_offset"],
            fc1_bias=fields["expert_fc1_bias"],
            fc2_bias=fields["expert_fc2_bias"],
        )

    def describe(self) -> str:
        """A short human name: "SwiGLU", "glu(quick_gelu, clamp 7.0, offset 1.0) + biases", "mlp(squared_relu)"."""
        if self.kind == "linear":
            name = "linear"
        elif self.kind == "glu" and self.activation == "silu" and self.clamp is None and not self.linear_offset:
            name = "SwiGLU"
        else:
            extras = ([f"clamp {self.clamp}"] if self.clamp is not None else []) + (
                [f"offset {self.linear_offset}"] if self.linear_offset else []
            )
            name = f"{self.kind}({', '.join([self.activation, *extras])})"
        biases = [n for n, on in (("fc1", self.fc1_bias), ("fc2", self.fc2_bias)) if on]
        return name + (f" + {' and '.join(biases)} bias" if biases else "")


SWIGLU = MoKExpertFamily()
# The MoKConfig (and run-config model) fields that name a family, in `config_fields` order.
FAMILY_FIELDS: tuple[str, ...] = tuple(SWIGLU.config_fields())


def family_field_problems(
    fields: dict[str, object], prefix: str, hidden_size: int, ffn_hidden_size: int, shared_field: str | None
) -> list[str]:
    """What is wrong with a layer's family fields (MoKConfig's names, reported as `prefix.<field>`):
    a clamp or offset on a non-glu expert; a linear expert that is not H x H, has an fc1 bias or
    has shared experts (shared_field: the field that asks for them with its value, e.g.
    "num_shared_experts=1"; None when none do). One list, so
    that MoKConfig and a run config's model section say the same."""
    kind = fields["expert_kind"]
    problems = []
    if kind != "glu":
        for name, default in (("activation_clamp", None), ("glu_linear_offset", 0.0)):
            if fields[name] != default:
                problems.append(
                    f"{prefix}.{name}={fields[name]} applies to glu experts only; {prefix}.expert_kind={kind!r}"
                )
    if kind == "linear":
        if ffn_hidden_size != hidden_size:
            problems.append(
                f"{prefix}.expert_kind='linear' (one H x H linear per expert) needs {prefix}.ffn_hidden_size = "
                f"{prefix}.hidden_size={hidden_size}, got {ffn_hidden_size}"
            )
        if fields["expert_fc1_bias"]:
            problems.append(
                f"{prefix}.expert_fc1_bias: a linear expert has one linear; its bias is {prefix}.expert_fc2_bias"
            )
        if shared_field:
            problems.append(f"{prefix}.{shared_field}: shared experts are MLPs; {prefix}.expert_kind='linear' has none")
    return problems


def _act(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu":
        return F.gelu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    if activation == "quick_gelu":
        return g * torch.sigmoid(QUICK_GELU_ALPHA * g)
    if activation == "relu":
        return F.relu(g)
    return F.relu(g).square()  # squared_relu


def activation(h: torch.Tensor, family: MoKExpertFamily) -> torch.Tensor:
    """A = the family's activation of h [..., fc1 rows], in h's dtype (a linear expert: h itself)."""
    if family.kind == "linear":
        return h
    if family.kind == "mlp":
        return _act(h, family.activation)
    gate, up = h.chunk(2, dim=-1)
    if family.clamp is not None:
        gate = gate.clamp(max=family.clamp)
        up = up.clamp(min=-family.clamp, max=family.clamp)
    return _act(gate, family.activation) * (up + family.linear_offset)


def activation_fp64(h: torch.Tensor, family: MoKExpertFamily) -> torch.Tensor:
    """A = the family's activation of h [..., fc1 rows] (for linear, h is the input row), computed
    in fp64; fp64 result."""
    return activation(h.double(), family)


def activation_backward_fp64(h: torch.Tensor, d_a: torch.Tensor, family: MoKExpertFamily) -> torch.Tensor:
    """dL/dh from dL/dA (both fp64 math; fp64 result), by autograd of `activation_fp64`, so the
    derivative conventions (relu at 0, the clamp's closed range) are torch's."""
    with torch.enable_grad():
        h64 = h.double().detach().requires_grad_(True)
        (d_h,) = torch.autograd.grad(activation(h64, family), h64, d_a.double())
    return d_h


def check_expert_weights(
    family: MoKExpertFamily,
    gate_up_proj: torch.Tensor | None,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    stacked: bool = True,
) -> None:
    """Raise ValueError unless the tensors are the ones `family` computes with, of matching shapes.

    stacked: the routed experts' [E, ...] tensors (True) or one shared MLP's (False).
    """
    lead = 1 if stacked else 0
    H = down_proj.shape[lead]
    if family.kind == "linear":
        if gate_up_proj is not None:
            raise ValueError("a linear expert has no gate_up_proj (its one linear is down_proj [E, H, H])")
        if down_proj.shape[lead + 1] != H:
            raise ValueError(f"a linear expert's down_proj must be square, got {tuple(down_proj.shape)}")
    else:
        if gate_up_proj is None:
            raise ValueError(f"a {family.kind} expert needs gate_up_proj")
        I = down_proj.shape[lead + 1]
        if gate_up_proj.shape[lead] != family.fc1_width(I) or gate_up_proj.shape[lead + 1] != H:
            raise ValueError(
                f"gate_up_proj {tuple(gate_up_proj.shape)} does not fit a {family.kind} expert with down_proj "
                f"{tuple(down_proj.shape)} (fc1 rows {family.fc1_width(I)}, H {H})"
            )
    fc1_rows = None if gate_up_proj is None else gate_up_proj.shape[lead]
    for name, tensor, flag, wanted, width in (
        ("gate_up_bias", gate_up_bias, "fc1_bias", family.fc1_bias, fc1_rows),
        ("down_bias", down_bias, "fc2_bias", family.fc2_bias, H),
    ):
        if (tensor is not None) != wanted:
            raise ValueError(
                f"{name} is {'given' if tensor is not None else 'missing'} but the family has {flag}={wanted}"
            )
        if tensor is not None and tuple(tensor.shape[lead:]) != (width,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; its last dimension must be {width}")
