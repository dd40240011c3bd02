"""State-dict keys of the DeepSpeed adapter: MoK's tensors under the stock MoE layer's names.

  MoK                              stock (what DeepSpeed's per-expert checkpoint files expect)
  mok.router.weight                deepspeed_moe.gate.wg.weight
  mok.experts.gate_up_proj[i]      deepspeed_moe.experts.deepspeed_experts.{i}.<gate> and .<up>
  mok.experts.down_proj[i]         deepspeed_moe.experts.deepspeed_experts.{i}.<down>

<gate>/<up>/<down> are the expert module's own parameter names (gate_proj.weight, w1.weight, ...),
so a stock layer's checkpoint loads into MoK and MoK's into a stock layer. DeepSpeed's engine
writes every key containing "expert" to the per-expert files, parsing the local expert id from
`deepspeed_moe.experts.deepspeed_experts.<i>.`; these keys keep that form.
"""

from __future__ import annotations

from typing import Any

import torch

from mok_plugin.deepspeed.experts import ExpertLayout

__all__ = ["install_state_dict_hooks"]

ROUTER = ("mok.router.weight", "deepspeed_moe.gate.wg.weight")
EXPERT = "deepspeed_moe.experts.deepspeed_experts.{}."


def install_state_dict_hooks(layer: torch.nn.Module, layout: ExpertLayout) -> None:
    """Make `layer.state_dict()` / `layer.load_state_dict()` use the stock MoE layer's keys."""

    def to_stock(module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + ROUTER[1]] = state_dict.pop(prefix + ROUTER[0])
        gate_up = state_dict.pop(prefix + "mok.experts.gate_up_proj")
        down = state_dict.pop(prefix + "mok.experts.down_proj")
        I = layout.ffn_hidden_size
        for i in range(gate_up.shape[0]):
            expert = prefix + EXPERT.format(i)
            state_dict[expert + layout.gate] = gate_up[i, :I]
            state_dict[expert + layout.up] = gate_up[i, I:]
            state_dict[expert + layout.down] = down[i]

    def from_stock(module, state_dict: dict, prefix: str, *args: Any) -> None:
        if prefix + ROUTER[1] in state_dict:
            state_dict[prefix + ROUTER[0]] = state_dict.pop(prefix + ROUTER[1])
        num_local = module.mok.experts.gate_up_proj.shape[0]
        names = [
            prefix + EXPERT.format(i) + name for i in range(num_local) for name in (layout.gate, layout.up, layout.down)
        ]
        if not all(name in state_dict for name in names):
            return  # MoK's own keys, or an incomplete checkpoint: load_state_dict reports what is missing
        gate_up, down = [], []
        for i in range(num_local):
            expert = prefix + EXPERT.format(i)
            gate_up.append(torch.cat([state_dict.pop(expert + layout.gate), state_dict.pop(expert + layout.up)]))
            down.append(state_dict.pop(expert + layout.down))
        state_dict[prefix + "mok.experts.gate_up_proj"] = torch.stack(gate_up)
        state_dict[prefix + "mok.experts.down_proj"] = torch.stack(down)

    layer.register_state_dict_post_hook(to_stock)
    layer.register_load_state_dict_pre_hook(from_stock)
