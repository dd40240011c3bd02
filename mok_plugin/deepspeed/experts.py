"""The SwiGLU expert modules the DeepSpeed adapter accepts, and how their weights map to MoK's.

MoK stacks each rank's experts as gate_up [E_l, 2I, H] (gate rows first) and down [E_l, H, I].
DeepSpeed's MoE takes one `expert` module and copies it per local expert; the adapter accepts:
  - `SwiGLUExpert(hidden_size, ffn_hidden_size)` (this module; Hugging Face names);
  - Hugging Face / Qwen / DeepSeek style: `gate_proj`, `up_proj`, `down_proj` (nn.Linear, no bias);
  - Mixtral style: `w1` (gate), `w3` (up), `w2` (down) (nn.Linear, no bias).
Anything else is an error that says what is accepted. The layout alone does not say what a module
computes (a Gemma-style gate/up/down MLP uses GeLU), so the module is also run once on a few seeded
rows and must give down(silu(gate(x)) * up(x)) from its own weights; one that does not is an error,
never computed as SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mok_plugin.reference import swiglu

__all__ = ["SwiGLUExpert", "ExpertLayout", "expert_layout"]


class SwiGLUExpert(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the expert MoK computes."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_STYLES = {"huggingface": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@dataclass(frozen=True)
class ExpertLayout:
    """Where an expert module keeps its gate, up and down weights, and its sizes."""

    gate: str  # parameter names inside the expert, e.g. "gate_proj.weight"
    up: str
    down: str
    hidden_size: int
    ffn_hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def stacked_weights(self, expert: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert module."""
        params = dict(expert.named_parameters())
        return torch.cat([params[self.gate], params[self.up]]), params[self.down]


def expert_layout(expert: nn.Module) -> ExpertLayout:
    """Recognise a SwiGLU expert module.

    Raises:
        TypeError: not one of the accepted layouts (or biased, or inconsistent shapes).
    """
    for names in _STYLES.values():
        linears = [getattr(expert, name, None) for name in names]
        if not all(isinstance(m, nn.Linear) for m in linears):
            continue
        gate, up, down = linears
        if any(m.bias is not None for m in linears):
            raise TypeError(f"{type(expert).__name__}: MoK's experts have no biases; build the expert with bias=False")
        H, I = gate.in_features, gate.out_features
        if (up.in_features, up.out_features, down.in_features, down.out_features) != (H, I, I, H):
            raise TypeError(f"{type(expert).__name__}: gate {H}->{I}, up {up.in_features}->{up.out_features}, "
                            f"down {down.in_features}->{down.out_features} do not form a SwiGLU MLP")  # fmt: skip
        layout = ExpertLayout(f"{names[0]}.weight", f"{names[1]}.weight", f"{names[2]}.weight", H, I,
                              gate.weight.dtype, gate.weight.device)  # fmt: skip
        _check_computes_swiglu(expert, layout)
        return layout
    accepted = "; ".join(f"{style}: {', '.join(names)}" for style, names in _STYLES.items())
    raise TypeError(
        f"mok_plugin.deepspeed.MoE runs SwiGLU experts only; {type(expert).__name__} has none of the accepted "
        f"layouts (nn.Linear attributes, no bias): {accepted}. Use mok_plugin.deepspeed.SwiGLUExpert"
    )


# Relative difference (Frobenius norms) between the module's output and SwiGLU from its weights
# below which the module computes SwiGLU: rounding of a 16-bit module's own GEMMs stays under 1e-2,
# an fp32 one (tf32 on a GPU) under 1e-3; another activation (GeLU, ReLU) differs by 0.1 or more.
_SWIGLU_TOLERANCE = {2: 5e-2, 4: 5e-3, 8: 1e-6}


def _check_computes_swiglu(expert: nn.Module, layout: ExpertLayout) -> None:
    """Raise TypeError unless `expert` computes down(silu(gate(x)) * up(x)) with its own weights,
    checked on 4 seeded rows in eval mode (no dropout), with no gradient; its mode is restored.
    Modules on the meta device (no values yet) are not checked."""
    if layout.device.type == "meta":
        return
    name = type(expert).__name__
    x = torch.randn(4, layout.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device=layout.device, dtype=layout.dtype)
    was_training = expert.training
    expert.eval()
    try:
        with torch.no_grad():
            got = expert(x)
    except Exception as error:  # a module that cannot run on [rows, H] is no expert MoK can replace
        raise TypeError(
            f"{name}: calling the expert on a [4, {layout.hidden_size}] input failed "
            f"({type(error).__name__}: {str(error)[:120]}); MoK checks what an expert computes before replacing it"
        ) from error
    finally:
        expert.train(was_training)
    with torch.no_grad():
        gate_up, down = (w.double() for w in layout.stacked_weights(expert))
        want = swiglu(x.double() @ gate_up.T) @ down.T  # the core's SwiGLU, in fp64
        diff = float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
    if not (diff <= _SWIGLU_TOLERANCE.get(layout.dtype.itemsize, 5e-2)):
        raise TypeError(
            f"{name}: its linears are laid out as gate/up/down, but it does not compute "
            f"down(silu(gate(x)) * up(x)) (relative difference {diff:.2g} on a probe): MoK's experts are SwiGLU "
            "only, and another activation (GeLU, ReLU, ...) would be computed wrongly"
        )
