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

Routing is DeepSpeed's gate (TopKGate with top1gating, top2gating, topkgating), computed by
gating.py's `DeepSpeedGate` as `self.mok.routing_fn`: the experts chosen, the capacity
(capacity_factor in training, eval_capacity_factor in eval, min_capacity, drop_tokens=False
dropless) and which tokens each expert keeps, per rank as DeepSpeed (so also with ep_size > 1),
the weights, `l_aux` (unscaled; k = 2 counts first choices only, as DeepSpeed) and `exp_counts`,
and `used_token` (top-1 only, as DeepSpeed). Ties that DeepSpeed leaves to torch.topk go to the
lower token (expert) index. The router logits are fp64 (MoK's batch-invariant router), DeepSpeed's
fp32.

Settings that are random in DeepSpeed (`noisy_gate_policy` 'RSample' and 'Jitter', `use_rts`,
`top2_2nd_expert_sampling`) draw DeepSpeed's distributions from MoK's counter-based stream, keyed
by (mok random_seed, the layer's training-forward count, the layer's number, global token index,
expert or hidden column): bitwise repeatable, the same for every ep_size. The layer's number is
the order in which this process built its mok_plugin.deepspeed.MoE layers (0, 1, ...), in
`layer.mok.routing_fn.layer`; the count is `layer.mok.routing_fn.step` (set both to resume a run
elsewhere). Dropped pairs run with weight 0 (exact zeros), so every ep_size computes the same rows
(gating.py).

`use_tutel=True` is accepted and changes nothing: in DeepSpeed it only picks Tutel's kernels for
the same dispatch (fast_cumsum_sub_one is cumsum - 1, fast_dispatcher's encode/decode the same
scatter and weighted gather), and MoK replaces the dispatcher. `use_residual=True` (Residual-MoE,
PR-MoE) is DeepSpeed's: `mlp` is the given expert module itself, run as itself beside MoK's
experts, and `coefficient = Linear(H, 2)` mixes the two outputs per token with a softmax.

`layer.deepspeed_moe.gate.wg` and `layer.deepspeed_moe.experts.deepspeed_experts[i]` exist as in
the stock layer, as views of MoK's weights (structure.py).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE as StockMoE
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size
from torch import nn

from mok_plugin.config import MoKConfig, MoKConfigError, dtype_name, load_config, short_repr
from mok_plugin.deepspeed.checkpoint import install_state_dict_hooks
from mok_plugin.deepspeed.config import DEEPSPEED_KNOBS
from mok_plugin.deepspeed.experts import ExpertLayout, ExpertNotRecognised, expert_layout
from mok_plugin.deepspeed.gating import NOISY_GATE_POLICIES, DeepSpeedGate
from mok_plugin.deepspeed.structure import build_stock_structure
from mok_plugin.layer import MoKMoE
from mok_plugin.module_experts import MoKModuleExperts

__all__ = ["MoE", "set_default_knobs"]

# A mok_config sets DEEPSPEED_KNOBS (MoK's knobs, fp8, fp8_scaling) freely; every other field follows DeepSpeed's
# arguments (or MoK's default where DeepSpeed has no such option, e.g. shared experts), so a mok_config
# may only repeat those values: it cannot add shared experts or change routing behind DeepSpeed's back.


# The random streams' layer numbers: the order in which this process builds its layers.
_LAYER_NUMBERS = itertools.count()

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


def _check_options(noisy_gate_policy, enable_expert_tensor_parallelism: bool) -> None:
    """The constructor arguments MoK refuses (every other one is DeepSpeed's, honoured)."""
    problems = []
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        problems.append(f"noisy_gate_policy={noisy_gate_policy!r}: DeepSpeed allows {NOISY_GATE_POLICIES}")
    if enable_expert_tensor_parallelism:
        problems.append("enable_expert_tensor_parallelism=True is not implemented")
    if problems:
        raise MoKConfigError("mok_plugin.deepspeed.MoE:\n  " + "\n  ".join(problems))


def _data_parallel_group():
    """DeepSpeed's data-parallel group (the random streams number tokens over it), or None on one rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return None
    return groups._get_data_parallel_group()


class MoE(StockMoE):
    """DeepSpeed's MoE layer running MoK; the stock constructor plus `mok_config`.

    Args:
        hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
        min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
        enable_expert_tensor_parallelism, top2_2nd_expert_sampling: as for deepspeed.moe.layer.MoE.
            `expert` is any module taking and returning [..., H]; every local expert starts as
            a copy of it. A MoK family runs fused, anything else as itself (module docstring).
            Routing, capacity, dropping and the random options are DeepSpeed's (module docstring).
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
        _check_options(noisy_gate_policy, enable_expert_tensor_parallelism)
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
        derived = dict(
            hidden_size=hidden_size,
            # Expert modules have no ffn_hidden_size; the config's family fields are unused then.
            ffn_hidden_size=layout.ffn_hidden_size if layout else hidden_size,
            **(layout.family.config_fields() if layout else {}),
            num_experts=num_experts,
            top_k=k,
            ep_size=ep_size,
            capacity_factor=None,  # DeepSpeed's gate (routing_fn) drops; MoK's schedule keeps what it gets
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
            if field not in DEEPSPEED_KNOBS
        }
        conflicts = [
            f"mok.{key}={short_repr(knobs[key])} (the arguments give {set_by_arguments[key]!r}; "
            f"a mok_config may set only {', '.join(DEEPSPEED_KNOBS)})"
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
        self.use_residual = use_residual
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
        self.mok.random_stream_layer = next(_LAYER_NUMBERS)  # the gate's stream number, also kept here
        self.mok.routing_fn = DeepSpeedGate(
            k=k, num_experts=num_experts, capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity, noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling, seed=self.mok_config.random_seed,
            layer=self.mok.random_stream_layer, token_group=_data_parallel_group,
        )  # fmt: skip
        for param in self.mok.experts.parameters():
            param.allreduce = False
            param.group_name = self.expert_group_name
        install_state_dict_hooks(self, layout)
        # The stock structure (deepspeed_moe.gate.wg, .experts.deepspeed_experts[i]) as views of MoK's
        # weights, not a submodule: no parameter or state-dict key of its own (structure.py).
        object.__setattr__(self, "deepspeed_moe", build_stock_structure(self, expert, layout, k))
        if use_residual:  # Residual-MoE, as DeepSpeed builds it: the given module itself is the dense MLP
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

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
        """Called by deepspeed.initialize (after it stores its mpu): refuse tensor parallelism, make
        sure the expert groups exist (EP = 1 included)."""
        tensor_parallel = bwc_tensor_model_parallel_world_size(groups.mpu) if groups.mpu is not None else 1
        if tensor_parallel > 1:
            # Stock DeepSpeed splits each expert's capacity slots over the TP ranks (drop_tokens /
            # gather_tokens around the all-to-all) and reduces expert gradients accordingly; MoK
            # has not implemented or tested that, so it refuses rather than run differently.
            raise MoKConfigError(
                f"mok_plugin.deepspeed.MoE: tensor parallelism (the mpu's tensor-model-parallel size is "
                f"{tensor_parallel}) is not implemented; run the MoE model at tensor-parallel size 1 (as "
                "Megatron-DeepSpeed's MoE examples do: MP_SIZE=1)"
            )
        group = self._expert_parallel_group(use_data_before_expert_parallel_)
        if self.mok.ep_group is not None and group is not self.mok.ep_group:
            raise MoKConfigError(
                "the expert-parallel group changed after the layer was built "
                "(use_data_before_expert_parallelism); build the model after deepspeed.initialize "
                "settings are known"
            )

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """(output like hidden_states, l_aux scalar, exp_counts [E] before any drop: DeepSpeed's, int64,
        or used_token's dtype for k = 1). used_token: [...] 0/1 per token, like hidden_states' leading
        dims (top-1 only; ignored for k >= 2, as DeepSpeed)."""
        gate = self.mok.routing_fn
        gate.used_token = None if used_token is None else used_token.reshape(-1)
        try:
            output, l_aux = self.mok(hidden_states)
        finally:
            gate.used_token = None
        if self.use_residual:  # Residual-MoE, DeepSpeed's MoE.forward term for term
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]  # DeepSpeed ignores a returned bias too
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, gate.last.exp_counts
