"""State-dict keys of the DeepSpeed adapter: MoK's tensors under the stock MoE layer's names.

  MoK                                   stock (what DeepSpeed's per-expert checkpoint files expect)
  mok.router.weight                     deepspeed_moe.gate.wg.weight
  a recognised family (experts.py):
  mok.experts.gate_up_proj[i], ...      deepspeed_moe.experts.deepspeed_experts.{i}.<the expert's names>
  expert modules (module_experts.py):
  mok.experts.local_experts.{i}.<name>  deepspeed_moe.experts.deepspeed_experts.{i}.<name>

For a family, `ExpertLayout.to_stock` / `to_mok` place the rows of gate_up_proj, gate_up_bias,
down_proj and down_bias in the expert's own parameters (gate_proj.weight, w1.bias, fc1.weight, a
fused [gate; up] dense_h_to_4h.weight, ...). So a stock layer's checkpoint loads into MoK and MoK's
into a stock layer. DeepSpeed's engine writes every key containing "expert" to the per-expert
files, parsing the local expert id from `deepspeed_moe.experts.deepspeed_experts.<i>.`; these keys
keep that form.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mok_plugin.deepspeed.experts import ExpertLayout

__all__ = ["install_state_dict_hooks"]

ROUTER = ("mok.router.weight", "deepspeed_moe.gate.wg.weight")
EXPERT = "deepspeed_moe.experts.deepspeed_experts.{}."
MODULES = "mok.experts.local_experts."
STOCK_MODULES = "deepspeed_moe.experts.deepspeed_experts."


def install_state_dict_hooks(layer: torch.nn.Module, layout: ExpertLayout | None) -> None:
    """Make `layer.state_dict()` / `layer.load_state_dict()` use the stock MoE layer's keys;
    `layout` None: the experts are modules (their keys are renamed, their tensors kept). The hooks
    are module-level functions bound to `layout`, so the layer pickles (torch.save(model))."""
    layer.register_state_dict_post_hook(functools.partial(_to_stock, layout=layout))
    layer.register_load_state_dict_pre_hook(functools.partial(_from_stock, layout=layout))


def _to_stock(module, state_dict: dict, prefix: str, local_metadata: Any, *, layout: ExpertLayout | None) -> None:
    state_dict[prefix + ROUTER[1]] = state_dict.pop(prefix + ROUTER[0])
    if layout is None:
        _rename(state_dict, prefix + MODULES, prefix + STOCK_MODULES)
        return
    stacked = {name: state_dict.pop(prefix + "mok.experts." + name) for name in layout.mok_names}
    for i in range(stacked["down_proj"].shape[0]):
        for name, tensor in layout.to_stock({k: v[i] for k, v in stacked.items()}).items():
            state_dict[prefix + EXPERT.format(i) + name] = tensor


def _from_stock(module, state_dict: dict, prefix: str, *args: Any, layout: ExpertLayout | None) -> None:
    if prefix + ROUTER[1] in state_dict:
        state_dict[prefix + ROUTER[0]] = state_dict.pop(prefix + ROUTER[1])
    if layout is None:
        _rename(state_dict, prefix + STOCK_MODULES, prefix + MODULES)
        return
    num_local = module.mok.experts.down_proj.shape[0]
    names = [prefix + EXPERT.format(i) + name for i in range(num_local) for name in layout.stock_names]
    if not all(name in state_dict for name in names):
        return  # MoK's own keys, or an incomplete checkpoint: load_state_dict reports what is missing
    per_expert = []
    for i in range(num_local):
        expert = prefix + EXPERT.format(i)
        per_expert.append(layout.to_mok({name: state_dict.pop(expert + name) for name in layout.stock_names}))
    for name in layout.mok_names:
        state_dict[prefix + "mok.experts." + name] = torch.stack([tensors[name] for tensors in per_expert])


def _rename(state_dict: dict, old: str, new: str) -> None:
    """Keys starting with `old` start with `new` instead, in place, keeping their order."""
    for key in [key for key in state_dict if key.startswith(old)]:
        state_dict[new + key[len(old) :]] = state_dict.pop(key)
