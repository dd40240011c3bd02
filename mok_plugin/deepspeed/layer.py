"""`mok_plugin.deepspeed.MoE`: DeepSpeed's MoE layer, running MoK.

A subclass of `deepspeed.moe.layer.MoE` with its constructor, so DeepSpeed's engine sees an MoE:
expert-parallel and expert-data-parallel groups (`set_deepspeed_parallelism`), expert parameters
tagged `allreduce=False` / `group_name` (gradient reduction over expert-data-parallel ranks, MoE
optimizer groups), per-expert checkpoint files (the state dict speaks the stock keys:
`deepspeed_moe.gate.wg.weight`, `deepspeed_moe.experts.deepspeed_experts.{i}.<expert names>`).
It returns `(output, l_aux, exp_counts)` like the stock layer.

Experts: any module. One that computes a MoK family (experts.py checks which, numerically) runs
fused, its weights placed in MoK's layout; any other runs as itself, one call per expert on that
expert's rows in order (module_experts.py), around MoK's routing, schedule and combine:
deterministic and the same for every ep_size, unfused, with a warning (once per layer) naming why.

Routing as DeepSpeed's gates define it: softmax over the experts, top-k; the k weights
renormalised for k >= 2; `l_aux` unscaled (the caller multiplies by its coefficient):
E * sum_e mean_t(p_te) * count_e / (k T) — DeepSpeed's top-1 and top-k (k >= 3) formula; for k = 2
DeepSpeed counts first choices only, MoK counts both (a warning says so).

Settings that are random in DeepSpeed: `noisy_gate_policy` (RSample, Jitter) and `use_tutel` are
errors; `use_rts=True` (random choice of the dropped tokens) and `top2_2nd_expert_sampling=True`
(Gumbel sampling of the 2nd expert) get their deterministic equivalents, with a warning: tokens
are kept in (token, k) order, and the 2nd expert is the 2nd-highest score.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from deepspeed.moe.layer import MoE as StockMoE
from deepspeed.utils import groups
from torch import nn

from mok_plugin.config import MOK_KNOBS, MoKConfig, MoKConfigError, dtype_name, load_config, short_repr
from mok_plugin.deepspeed.checkpoint import install_state_dict_hooks
from mok_plugin.deepspeed.experts import ExpertLayout, ExpertNotRecognised, expert_layout
from mok_plugin.layer import MoKMoE
from mok_plugin.module_experts import MoKModuleExperts

__all__ = ["MoE", "set_default_knobs"]

# A mok_config sets MOK_KNOBS freely; every other field follows DeepSpeed's arguments (or MoK's
# default where DeepSpeed has no such option, e.g. shared experts), so a mok_config may only repeat
# those values: it cannot add shared experts or change routing behind DeepSpeed's back.


# Knobs for layers built without a mok_config (through apply(ds_config) or the source patch).
_DEFAULT_KNOBS: dict[str, Any] = {}


def set_default_knobs(knobs: dict[str, Any]) -> None:
    """MoK knobs used by MoE layers built without a mok_config (switch.py sets them)."""
    _DEFAULT_KNOBS.clear()
    _DEFAULT_KNOBS.update(knobs)


def _knobs(mok_config: MoKConfig | dict | str | Path | None) -> dict[str, Any]:
    if mok_config is None:
        return dict(_DEFAULT_KNOBS)
    if isinstance(mok_config, MoKConfig):
        return mok_config.model_dump(exclude_unset=True)
    if isinstance(mok_config, dict):
        return {key: dtype_name(value) if key == "params_dtype" else value for key, value in mok_config.items()}
    return load_config(mok_config).model_dump(exclude_unset=True)


def _check_deterministic_options(
    k: int,
    noisy_gate_policy,
    use_tutel: bool,
    use_rts: bool,
    drop_tokens: bool,
    top2_2nd_expert_sampling: bool,
    use_residual: bool,
    enable_expert_tensor_parallelism: bool,
) -> None:
    problems = []
    if noisy_gate_policy not in (None, "None"):
        problems.append(f"noisy_gate_policy={noisy_gate_policy!r} adds random noise to routing; use None")
    if use_tutel:
        problems.append("use_tutel=True: MoK replaces the dispatcher; Tutel's kernels are not deterministic")
    if use_residual:
        problems.append("use_residual=True (Residual-MoE) is not implemented")
    if enable_expert_tensor_parallelism:
        problems.append("enable_expert_tensor_parallelism=True is not implemented")
    if problems:
        raise MoKConfigError("mok_plugin.deepspeed.MoE:\n  " + "\n  ".join(problems))
    if use_rts and drop_tokens and k == 1:
        warnings.warn(
            "MoK: use_rts=True (random token selection) runs as its deterministic equivalent: "
            "over-capacity tokens are dropped in token order",
            stacklevel=3,
        )
    if top2_2nd_expert_sampling and k == 2:
        warnings.warn(
            "MoK: top2_2nd_expert_sampling=True runs as its deterministic equivalent: the 2nd expert "
            "is the 2nd-highest score (pass top2_2nd_expert_sampling=False to silence this)",
            stacklevel=3,
        )
    if k == 2:
        warnings.warn(
            "MoK: with k=2 the aux loss counts both choices of each token (DeepSpeed's top-2 gate "
            "counts first choices only; its top-k gate, k >= 3, counts all, as MoK does)",
            stacklevel=3,
        )


class MoE(StockMoE):
    """DeepSpeed's MoE layer running MoK; the stock constructor plus `mok_config`.

    Args:
        hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
        min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
        enable_expert_tensor_parallelism, top2_2nd_expert_sampling: as for deepspeed.moe.layer.MoE.
            `expert` is any module taking and returning [..., H]; every local expert starts as
            a copy of it. A MoK family runs fused, anything else as itself (module docstring).
            `drop_tokens=True` drops over-capacity (token, k) pairs in token order at
            capacity ceil(T * k / E * capacity_factor) (single EP rank only; `min_capacity` is not
            applied); `drop_tokens=False` is dropless.
        mok_config: MoK knobs (a MoKConfig, a dict of its fields, or a YAML path); its shape and
            routing fields must agree with the arguments.
    Raises:
        MoKConfigError: a random or unsupported option, a conflicting mok_config, or
            ep_size > 1 before torch.distributed is initialised.
    Warns:
        UserWarning: once, when the expert is no MoK family and runs as itself (unfused).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        mok_config: MoKConfig | dict | str | Path | None = None,
    ) -> None:
        _check_deterministic_options(
            k,
            noisy_gate_policy,
            use_tutel,
            use_rts,
            drop_tokens,
            top2_2nd_expert_sampling,
            use_residual,
            enable_expert_tensor_parallelism,
        )
        try:
            layout: ExpertLayout | None = expert_layout(expert, hidden_size)
        except ExpertNotRecognised as why:
            layout = None
            warnings.warn(
                f"MoK: the expert {type(expert).__name__} is none of MoK's expert families ({why}); each expert "
                "runs this module on its own rows (mok_plugin.module_experts): deterministic and the same for "
                "every ep_size, but unfused and slower than a fused family",
                stacklevel=2,
            )
        first = next(expert.parameters(), None)
        dtype = layout.dtype if layout else first.dtype if first is not None else torch.get_default_dtype()
        device = layout.device if layout else first.device if first is not None else None
        if num_experts % ep_size:
            raise MoKConfigError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        if drop_tokens and capacity_factor != eval_capacity_factor:
            raise MoKConfigError(
                f"capacity_factor={capacity_factor} and eval_capacity_factor={eval_capacity_factor}: "
                "MoK uses one capacity factor; set them equal or drop_tokens=False"
            )
        if drop_tokens and ep_size > 1:
            raise MoKConfigError(
                "drop_tokens=True with ep_size > 1: MoK's capacity counts the global batch at each expert, "
                "DeepSpeed's each rank's own tokens; pass drop_tokens=False (dropless)"
            )
        derived = dict(
            hidden_size=hidden_size,
            # Expert modules have no ffn_hidden_size; the config's family fields are unused then.
            ffn_hidden_size=layout.ffn_hidden_size if layout else hidden_size,
            **(layout.family.config_fields() if layout else {}),
            num_experts=num_experts,
            top_k=k,
            ep_size=ep_size,
            capacity_factor=float(capacity_factor) if drop_tokens else None,
            score_function="softmax",
            norm_topk_prob=k >= 2,
            aux_loss_coeff=1.0,
            params_dtype=dtype_name(dtype),
            ep_exchange="exact",
        )
        knobs = _knobs(mok_config)
        set_by_arguments = {
            field: derived.get(field, info.default)
            for field, info in MoKConfig.model_fields.items()
            if field not in MOK_KNOBS
        }
        conflicts = [
            f"mok.{key}={short_repr(knobs[key])} (the arguments give {set_by_arguments[key]!r}; "
            f"a mok_config may set only {', '.join(MOK_KNOBS)})"
            for key in knobs
            if key in set_by_arguments and knobs[key] != set_by_arguments[key]
        ]
        if conflicts:
            raise MoKConfigError("mok_config conflicts with the MoE arguments: " + "; ".join(conflicts))
        self.mok_config = MoKConfig(**{**derived, **knobs})

        nn.Module.__init__(self)  # not StockMoE.__init__: it would build the stock gate and expert copies
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        self.use_residual = False
        ep_group = self._expert_parallel_group() if ep_size > 1 else None
        self.expert_layout = layout  # what the experts compute; None: the expert module itself
        # Every local expert starts as the given expert, as in DeepSpeed.
        if layout is None:
            modules = MoKModuleExperts([copy.deepcopy(expert) for _ in range(self.num_local_experts)])
            self.mok = MoKMoE(self.mok_config, ep_group=ep_group, device=device, experts=modules)
        else:
            self.mok = MoKMoE(self.mok_config, ep_group=ep_group, device=device)
            if device.type != "meta":
                with torch.no_grad():
                    weights = layout.to_mok(dict(expert.named_parameters()))
                    for name, tensor in weights.items():
                        stacked = getattr(self.mok.experts, name)
                        stacked.copy_(tensor.expand_as(stacked))
        for param in self.mok.experts.parameters():
            param.allreduce = False
            param.group_name = self.expert_group_name
        install_state_dict_hooks(self, layout)

    def _expert_parallel_group(self, use_data_before_expert_parallel_: bool = False):
        """DeepSpeed's EP group for this ep_size, created as DeepSpeed's MoE does when missing."""
        if not torch.distributed.is_initialized():
            raise MoKConfigError(f"ep_size={self.ep_size}: call deepspeed.init_distributed() before building the model")
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_
            )
        return groups._get_expert_parallel_group(self.expert_group_name)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by deepspeed.initialize: make sure the expert groups exist (EP = 1 included)."""
        group = self._expert_parallel_group(use_data_before_expert_parallel_)
        if self.mok.ep_group is not None and group is not self.mok.ep_group:
            raise MoKConfigError(
                "the expert-parallel group changed after the layer was built "
                "(use_data_before_expert_parallelism); build the model after deepspeed.initialize "
                "settings are known"
            )

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """(output like hidden_states, l_aux scalar, exp_counts int64 [E] before any drop)."""
        if used_token is not None:
            raise NotImplementedError("MoK routes every token; used_token masks are not supported")
        output, l_aux = self.mok(hidden_states)
        return output, l_aux, self.mok.last_tokens_per_expert.clone()
