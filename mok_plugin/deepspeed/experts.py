"""Which MoK expert family a DeepSpeed `expert` module computes, and where its weights go.

DeepSpeed's MoE takes one `expert` module and copies it per local expert. The adapter finds the
module's linear layers by structure, then checks numerically what it computes; it never assumes an
activation from a name. Recognised (H the layer's hidden size, names only as examples):

    module                                            linears          MoK family, weights
    HF gate_proj/up_proj/down_proj + act_fn            3: H->I x2, I->H  glu(act), gate_up = [gate_proj; up_proj]
      (Llama, Qwen2, Mistral, Gemma; mlp_bias=True)
    Mixtral w1/w3/w2 + act_fn                         3                 glu(act), gate_up = [w1; w3]
    Qwen-1 w1/w2/c_proj: c_proj(w1(x) * silu(w2(x)))  3                 glu(silu), gate_up = [w2; w1] (w2 is gated)
    Phi fc1/fc2 + activation, biases                  2: H->I, I->H     mlp(act), gate_up = fc1
    Sequential(Linear, activation, Linear)            2                 mlp(act)
    Megatron-DeepSpeed ParallelMLP                    2                 mlp(gelu | gelu_tanh | squared_relu), biases;
                                                      2: H->2I, I->H    --swiglu: glu(silu), gate_up = dense_h_to_4h
    one fused fc1 chunked as [up; gate] (GeGLU style)  2: H->2I, I->H    glu(act), gate_up = fc1 halves swapped
    Linear(H, H)                                      1                 linear, its bias -> fc2 bias
and biases wherever present (both halves of a glu's first layer, or neither). The activation is
whichever of experts.ACTIVATIONS the probe finds: a Gemma-style gate/up/down with GeLU is
glu(gelu) or glu(gelu_tanh), never SwiGLU.

How a module is recognised:
1. Structure. A *linear* is a submodule whose only parameters are a 2-D `weight` [out, in] and an
   optional 1-D `bias` (nn.Linear, Megatron's Column/RowParallelLinear, ...). Every parameter of
   the expert must sit in one, trainable, all of one dtype, and the expert has no buffers. By
   count and shape the linears give candidates: one H->H linear (linear); fc1 H->F and fc2 I->H
   (mlp for F = I; glu with fc1 = [gate; up] or [up; gate] for F = 2I); two H->I and one I->H
   (glu, either input linear as the gate); each with every activation.
2. Probe. The module runs through `torch.func.functional_call` (its own weights untouched) with
   seeded random fp64 weights and biases (whatever its own weights are: zeros, meta), on 8 rows at
   scales 1/4 to 64, in eval and in train mode, on the CPU. Each candidate's output comes from the
   same weights placed as the candidate places them: h = x W1^T + b1 (the placed columns of each
   linear's output), A = experts.activation_fp64(h, family), y = A W2^T + b2; so the probe checks
   the placement (which half is gated) as well as the activation. A candidate matches when every
   row agrees to a relative 1e-5, and exactly one may match. In fp64, gelu and gelu_tanh differ
   by about 2e-4 on the probe while the spellings of one function agree to 1e-6 or better (HF's
   NewGELU: 1e-16; Megatron's bias_gelu, sqrt(2/pi) to 8 digits: 2e-10; its erf_gelu, sqrt(2) to
   6 digits: 7e-7; a module that computes in fp32 inside: about 1e-7); the large rows expose a
   clamp (GPT-OSS's 7); train mode exposes dropout. The probe costs about 1.5 s for a
   4096 x 14336 SwiGLU expert on 2 CPU cores (drawing the random weights), once per layer.

Anything else is not an error (no expert is refused for its type): other parameters (a LayerNorm),
two linears with nothing between (no MoK family is the identity, and folding them into one linear
would change their gradients), a probe that cannot run, no match or two matches: `ExpertNotRecognised`
says why, and the layer runs the module itself per expert (module_experts.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mok_plugin.experts import ACTIVATIONS, MoKExpertFamily, activation_fp64

__all__ = ["ExpertLayout", "ExpertNotRecognised", "SwiGLUExpert", "expert_layout"]


class SwiGLUExpert(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: a ready-made expert MoK computes fused."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertNotRecognised(Exception):
    """The expert module computes none of MoK's families (the message says why)."""


@dataclass(frozen=True, slots=True)
class _Piece:
    """Rows [stock_start, +rows) of the expert's parameter `stock` are rows [mok_start, +rows) of
    MoK's per-expert tensor `mok` (gate_up_proj, gate_up_bias, down_proj, down_bias)."""

    stock: str
    stock_start: int
    mok: str
    mok_start: int
    rows: int


@dataclass(frozen=True)
class ExpertLayout:
    """What a recognised expert computes and where its parameters go in MoK's layout."""

    family: MoKExpertFamily
    hidden_size: int
    ffn_hidden_size: int
    dtype: torch.dtype
    device: torch.device
    pieces: tuple[_Piece, ...]

    @property
    def stock_names(self) -> tuple[str, ...]:
        """The expert's parameter names, in the order they first appear in `pieces`."""
        return tuple(dict.fromkeys(p.stock for p in self.pieces))

    @property
    def mok_names(self) -> tuple[str, ...]:
        """MoK's per-expert tensors this family has (MoKExperts attribute names)."""
        return tuple(dict.fromkeys(p.mok for p in self.pieces))

    def to_mok(self, stock: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert's MoK tensors (gate_up_proj [fc1 rows, H], ...) from its parameters by name."""
        return {name: _assemble(self.pieces, stock, name, by_mok=True) for name in self.mok_names}

    def to_stock(self, mok: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One expert's parameters by name from its MoK tensors (the inverse of `to_mok`)."""
        return {name: _assemble(self.pieces, mok, name, by_mok=False) for name in self.stock_names}


def _assemble(pieces, source: Mapping[str, torch.Tensor], name: str, by_mok: bool) -> torch.Tensor:
    """Tensor `name` on one side, from its pieces' rows on the other side, in row order."""
    if by_mok:
        mine = sorted((p for p in pieces if p.mok == name), key=lambda p: p.mok_start)
        parts = [source[p.stock][p.stock_start : p.stock_start + p.rows] for p in mine]
    else:
        mine = sorted((p for p in pieces if p.stock == name), key=lambda p: p.stock_start)
        parts = [source[p.mok][p.mok_start : p.mok_start + p.rows] for p in mine]
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


# --- structure ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Linear:
    name: str  # submodule path ("" for the expert itself)
    out_features: int
    in_features: int
    has_bias: bool

    def param(self, what: str) -> str:
        return f"{self.name}.{what}" if self.name else what


def _as_linear(name: str, module: nn.Module) -> _Linear | None:
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return None
    if bias is not None and (not isinstance(bias, nn.Parameter) or tuple(bias.shape) != (weight.shape[0],)):
        return None
    if {id(p) for p in module.parameters()} != {id(weight)} | ({id(bias)} if bias is not None else set()):
        return None
    return _Linear(name, weight.shape[0], weight.shape[1], bias is not None)


def _linears(expert: nn.Module) -> list[_Linear]:
    """The expert's linears, or ExpertNotRecognised when some parameter is outside them."""
    found: list[_Linear] = []
    for name, module in expert.named_modules():
        if any(f.name == "" or name == f.name or name.startswith(f.name + ".") for f in found):
            continue  # inside a linear already found
        linear = _as_linear(name, module)
        if linear is not None:
            found.append(linear)
    params = dict(expert.named_parameters(remove_duplicate=False))
    covered = {f.param("weight") for f in found} | {f.param("bias") for f in found if f.has_bias}
    others = sorted(set(params) - covered)
    if others:
        raise ExpertNotRecognised(f"parameters outside linear layers: {', '.join(others[:4])}")
    if len({id(p) for p in params.values()}) != len(params):
        raise ExpertNotRecognised("shared (tied) parameters")
    buffers = [name for name, _ in expert.named_buffers()]
    if buffers:
        raise ExpertNotRecognised(f"buffers: {', '.join(buffers[:4])}")
    if not found:
        raise ExpertNotRecognised("no linear layers")
    if len({p.dtype for p in params.values()}) > 1:
        raise ExpertNotRecognised("parameters of several dtypes")
    if not all(p.requires_grad for p in params.values()):
        raise ExpertNotRecognised("frozen parameters (requires_grad=False)")
    return found


# --- candidates --------------------------------------------------------------------------------


def _weight_and_bias(linear: _Linear, mok: str, mok_start: int, stock_start: int, rows: int) -> list[_Piece]:
    pieces = [_Piece(linear.param("weight"), stock_start, mok + "_proj", mok_start, rows)]
    if linear.has_bias:
        pieces.append(_Piece(linear.param("bias"), stock_start, mok + "_bias", mok_start, rows))
    return pieces


def _candidates(linears: list[_Linear], H: int) -> list[tuple[MoKExpertFamily, tuple[_Piece, ...], int]]:
    """(family, pieces, ffn_hidden_size) for every reading of the linears' shapes."""
    found = []

    def add(kind: str, fc1_bias: bool, fc2: _Linear, pieces: list[_Piece], I: int) -> None:
        down = _weight_and_bias(fc2, "down", 0, 0, H)
        for act in ACTIVATIONS if kind != "linear" else ("silu",):
            family = MoKExpertFamily(kind=kind, activation=act, fc1_bias=fc1_bias, fc2_bias=fc2.has_bias)
            found.append((family, tuple(pieces + down), I))

    if len(linears) == 1:
        (only,) = linears
        if (only.in_features, only.out_features) == (H, H):
            add("linear", False, only, [], H)
    elif len(linears) == 2:
        for fc1, fc2 in itertools.permutations(linears):
            if fc1.in_features != H or fc2.out_features != H:
                continue
            I = fc2.in_features
            if fc1.out_features == I:
                add("mlp", fc1.has_bias, fc2, _weight_and_bias(fc1, "gate_up", 0, 0, I), I)
            if fc1.out_features == 2 * I:
                add("glu", fc1.has_bias, fc2, _weight_and_bias(fc1, "gate_up", 0, 0, 2 * I), I)  # [gate; up]
                swapped = _weight_and_bias(fc1, "gate_up", 0, I, I) + _weight_and_bias(fc1, "gate_up", I, 0, I)
                add("glu", fc1.has_bias, fc2, swapped, I)  # [up; gate]
    elif len(linears) == 3:
        for gate, up, fc2 in itertools.permutations(linears):
            I = fc2.in_features
            shapes_fit = fc2.out_features == H and all((m.in_features, m.out_features) == (H, I) for m in (gate, up))
            if shapes_fit and gate.has_bias == up.has_bias:
                pieces = _weight_and_bias(gate, "gate_up", 0, 0, I) + _weight_and_bias(up, "gate_up", I, 0, I)
                add("glu", gate.has_bias, fc2, pieces, I)
    return found


# --- probe -------------------------------------------------------------------------------------

# Row scales of the probe input: small rows see an activation near 0, large ones its tails (a
# clamp, a cut-off); with weights ~ 1/sqrt(fan_in) a row's pre-activations are about its scale.
_PROBE_SCALES = (0.25, 0.5, 1.0, 1.0, 2.0, 4.0, 16.0, 64.0)
# Largest relative difference (per row, fp64) at which the module computes a candidate: above the
# spellings of one function (about 1e-6 at most, see the module docstring), well below the gap
# between two activations (gelu vs gelu_tanh: about 1e-4; others 1e-2 and more).
_PROBE_TOLERANCE = 1e-5


def _probe_inputs(expert: nn.Module, H: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    # Uniform values of variance 1/fan_in (weights) and 1/4 (biases): normal ones would do as well,
    # uniform ones are three times faster to draw, which counts for experts of 10^8 parameters.
    generator = torch.Generator().manual_seed(0)
    params = {}
    for name, p in expert.named_parameters():
        bound = math.sqrt(3.0 / p.shape[1]) if p.dim() == 2 else math.sqrt(3.0) * 0.5
        params[name] = torch.empty(tuple(p.shape), dtype=torch.float64).uniform_(-bound, bound, generator=generator)
    x = torch.randn(len(_PROBE_SCALES), H, generator=generator, dtype=torch.float64)
    return params, x * torch.tensor(_PROBE_SCALES, dtype=torch.float64).unsqueeze(1)


def _run_module(expert: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """The expert's output on x in eval and in train mode, with `params` in place of its own."""
    was_training = expert.training
    outputs = []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for training in (False, True):
                expert.train(training)
                out = torch.func.functional_call(expert, params, (x,))
                out = out[0] if isinstance(out, (tuple, list)) else out
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise ExpertNotRecognised(f"returns {got} for input rows {tuple(x.shape)}")
                outputs.append(out.double())
    except ExpertNotRecognised:
        raise
    except Exception as error:  # noqa: BLE001 - any failure means the probe cannot tell
        raise ExpertNotRecognised(f"the probe could not run it: {type(error).__name__}: {str(error)[:160]}") from error
    finally:
        expert.train(was_training)
    return outputs


def _row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    floor = float(want.norm()) * 1e-12 + 1e-300
    return float(((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(floor)).max())


def _candidate_outputs(candidates, params: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """Each candidate's output on x [n, H] in fp64: h = x W1^T + b1 with W1's rows placed as the
    candidate places them (computed as the placed columns of each linear's output, so that no
    weight is copied), A = experts.activation_fp64(h, family), y = A W2^T + b2. The second linear
    runs once for all candidates that share it."""

    def linear(weight: str, inputs: torch.Tensor) -> torch.Tensor:
        bias = params.get(weight[: -len("weight")] + "bias")
        out = inputs @ params[weight].t()
        return out if bias is None else out + bias

    fc1_outputs: dict[str, torch.Tensor] = {}
    activations: dict[str, list[tuple[int, torch.Tensor]]] = {}  # fc2 weight -> (candidate, A)
    for index, (family, pieces, _) in enumerate(candidates):
        fc1 = sorted((p for p in pieces if p.mok == "gate_up_proj"), key=lambda p: p.mok_start)
        for p in fc1:
            if p.stock not in fc1_outputs:
                fc1_outputs[p.stock] = linear(p.stock, x)
        h = torch.cat([fc1_outputs[p.stock][:, p.stock_start : p.stock_start + p.rows] for p in fc1], 1) if fc1 else x
        (down,) = (p.stock for p in pieces if p.mok == "down_proj")
        activations.setdefault(down, []).append((index, activation_fp64(h, family)))
    outputs: list[torch.Tensor] = [x] * len(candidates)
    for down, group in activations.items():
        ys = linear(down, torch.cat([a for _, a in group])).split(x.shape[0])
        for (index, _), y in zip(group, ys, strict=True):
            outputs[index] = y
    return outputs


def expert_layout(expert: nn.Module, hidden_size: int) -> ExpertLayout:
    """What `expert` computes, as a MoK family and a placement of its weights (module docstring).

    Raises:
        ExpertNotRecognised: none or several families match; the message says why.
    """
    linears = _linears(expert)
    candidates = _candidates(linears, hidden_size)
    if not candidates:
        shapes = ", ".join(f"{f.name or 'self'} {f.in_features}->{f.out_features}" for f in linears)
        raise ExpertNotRecognised(f"its linear layers ({shapes}) form no MoK family at hidden size {hidden_size}")
    params, x = _probe_inputs(expert, hidden_size)
    outputs = _run_module(expert, params, x)
    wanted = _candidate_outputs(candidates, params, x)
    matches = [
        candidate
        for candidate, want in zip(candidates, wanted, strict=True)
        if max(_row_error(out, want) for out in outputs) <= _PROBE_TOLERANCE
    ]
    if not matches:
        raise ExpertNotRecognised("its output matches no MoK family on a probe")
    if len(matches) > 1:
        names = ", ".join(family.describe() for family, *_ in matches)
        raise ExpertNotRecognised(f"its output matches several MoK families on a probe ({names})")
    family, pieces, I = matches[0]
    first = next(expert.parameters())
    return ExpertLayout(family, hidden_size, I, first.dtype, first.device, pieces)
