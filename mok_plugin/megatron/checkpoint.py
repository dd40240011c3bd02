"""Checkpoint keys of the Megatron adapter: MoK's stacked tensors under Megatron's stock names.

MoK holds each rank's experts stacked ([E_l, fc1 rows, H] and [E_l, H, I]; fc1 rows are 2I for a
GLU, gate rows first as in Megatron's GLU fc1, else I); Megatron's stock layer holds one fc1/fc2
pair per expert. This module maps between the two so that checkpoints move both ways:

  MoK (module tree)                      stock key (state_dict and sharded_state_dict)
  mok.router.weight, mok.router.bias     router.weight, router.bias (the bias with --add-bias-linear)
  mok.expert_bias                        router.expert_bias (--moe-router-enable-expert-bias; the
                                         per-step counts local_tokens_per_expert are not persistent,
                                         in MoK as in TopKRouter, so in no checkpoint)
  mok.experts.gate_up_proj[i]            experts.local_experts.{i}.linear_fc1.weight  (SequentialMLP)
  mok.experts.gate_up_bias[i]            experts.local_experts.{i}.linear_fc1.bias
  mok.experts.down_proj[i]               experts.local_experts.{i}.linear_fc2.weight
  mok.experts.down_bias[i]               experts.local_experts.{i}.linear_fc2.bias
  mok.shared_experts.gate_up_proj        shared_experts.linear_fc1.weight
  mok.shared_experts.down_proj           shared_experts.linear_fc2.weight
  (and gate_up_bias / down_bias          shared_experts.linear_fc1.bias / linear_fc2.bias)
  mok.shared_experts.gate_weight         shared_experts.gate_weight (--moe-shared-expert-gate; [1, H],
                                         replicated, as SharedExpertMLP.sharded_state_dict makes it)

Saving writes the SequentialMLP keys (with their `_extra_state` entries, None, as the stock local
layers write them). Loading also accepts TEGroupedMLP's `experts.linear_fc1.weight{i}` /
`experts.linear_fc1.bias{i}` keys. The sharded (distributed-checkpoint) tensors are built with
Megatron's own helpers, exactly as SequentialMLP and MLP build theirs: expert i is a shard of
`experts.experts.linear_fc1.weight` (and `.bias`) along a leading expert axis at its global index;
a GLU's fc1 weight and bias go through Megatron's SwiGLU factory (gate and linear halves). Each
stacked tensor is one ShardedTensorFactory holding the parameter itself, because Megatron's
optimizer finds its states' layout by parameter identity; the factory builds the per-expert shards
and stacks them back on load. The shared expert has no biases in Megatron (SharedExpertMLP refuses
them), so config_map refuses that combination; the names are mapped all the same.

Under tensor parallelism (TP > 1, expert TP 1) stock splits its shared expert over TP (fc1 rows, a
GLU's gate and linear halves each; fc2 columns) and MoK holds it whole on every TP rank: state_dict()
writes this rank's part as stock's does, and load_state_dict gathers the parts over TP (a collective:
every TP rank loads together, as Megatron's checkpoint loading does). The sharded checkpoint saves the
whole tensors as TP replicas of the same global tensors.

With --moe-mlp-glu-interleave-size S on a GLU, TEGroupedMLP stores each expert's fc1 rows (weight
and bias) in blocks of S rows, gate and linear alternating, and reorders them before its GLU;
SequentialMLP ignores the setting. So TEGroupedMLP's `weight{i}`/`bias{i}` keys are de-interleaved
to MoK's gate-first rows on load, and when the layer replaces TEGroupedMLP (its spec says so) the
sharded expert fc1 tensors are written interleaved and read back de-interleaved, as TEGroupedMLP's
sharded_state_dict stores them under the same keys. The SequentialMLP keys `state_dict()` writes
stay gate-first.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

__all__ = ["glu_deinterleave", "glu_interleave", "install_state_dict_hooks", "megatron_sharded_state_dict"]

# (MoK name relative to the layer, stock name): tensors that are renamed, not split.
_RENAMED = [
    ("mok.router.weight", "router.weight"),
    ("mok.router.bias", "router.bias"),
    ("mok.expert_bias", "router.expert_bias"),
    ("mok.shared_experts.gate_up_proj", "shared_experts.linear_fc1.weight"),
    ("mok.shared_experts.gate_up_bias", "shared_experts.linear_fc1.bias"),
    ("mok.shared_experts.down_proj", "shared_experts.linear_fc2.weight"),
    ("mok.shared_experts.down_bias", "shared_experts.linear_fc2.bias"),
    ("mok.shared_experts.gate_weight", "shared_experts.gate_weight"),
]
# Written by MoK layers before the counts became non-persistent; dropped on load (they are per-step
# counts that Megatron zeroes every global batch), so those checkpoints still load strictly.
_STALE = ("router.local_tokens_per_expert",)
# (MoK stacked name, fc name, leaf): split per local expert.
_STACKED = [
    ("mok.experts.gate_up_proj", "linear_fc1", "weight"),
    ("mok.experts.gate_up_bias", "linear_fc1", "bias"),
    ("mok.experts.down_proj", "linear_fc2", "weight"),
    ("mok.experts.down_bias", "linear_fc2", "bias"),
]
_EXTRA = "_extra_state"
# Stock's TP split of the shared expert (ColumnParallelLinear fc1, RowParallelLinear fc2): the axis.
_SHARED_SPLIT_OVER_TP = {
    "shared_experts.linear_fc1.weight": 0,
    "shared_experts.linear_fc1.bias": 0,
    "shared_experts.linear_fc2.weight": 1,
}


def _tp_group(module):
    """The layer's tensor-parallel group when it has more than one rank, else None."""
    group = getattr(getattr(module, "pg_collection", None), "tp", None)
    return group if group is not None and group.size() > 1 else None


def _tp_part(whole: torch.Tensor, axis: int, rank: int, size: int, glu: bool) -> torch.Tensor:
    """Stock's TP part `rank` of a whole shared-expert tensor (a GLU fc1: the rank's gate rows, then
    its linear rows). A copy: a view would save the whole storage."""
    halves = whole.detach().chunk(2, dim=0) if glu else (whole.detach(),)
    return torch.cat([half.chunk(size, dim=axis)[rank] for half in halves], dim=axis).clone()


def _split_as_glu(module, stock_name: str) -> bool:
    """Whether stock splits this shared-expert tensor over TP as a GLU's fc1 (each half on its own)."""
    return module.mok_config.expert_kind == "glu" and ".linear_fc1." in stock_name


def _gather_tp_parts(part: torch.Tensor, axis: int, group, glu: bool, device: torch.device) -> torch.Tensor:
    """The inverse of `_tp_part` over every rank of `group`, gathered on `device` (the parameter's:
    Megatron loads plain checkpoints to the CPU, and an NCCL group gathers CUDA tensors only)."""
    import torch.distributed as dist

    part = part.to(device)
    parts = [torch.empty_like(part) for _ in range(group.size())]
    dist.all_gather(parts, part.contiguous(), group=group)
    if not glu:
        return torch.cat(parts, dim=axis)
    gates, linears = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
    return torch.cat([*gates, *linears], dim=0)


def glu_deinterleave(rows: torch.Tensor, size: int) -> torch.Tensor:
    """fc1 rows (dim 0) in blocks of `size`, gate and linear alternating -> gate rows, then linear
    rows (TEGroupedMLP._remove_glu_interleaving, on dim 0)."""
    return rows.reshape(rows.shape[0] // (2 * size), 2, size, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def glu_interleave(rows: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `glu_deinterleave`: gate rows, then linear rows -> blocks of `size` alternating."""
    return rows.reshape(2, rows.shape[0] // (2 * size), size, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def _glu_interleave_size(layer) -> int | None:
    """S of --moe-mlp-glu-interleave-size on a GLU layer (TEGroupedMLP's fc1 row blocks), else None."""
    size = getattr(getattr(layer, "config", None), "moe_mlp_glu_interleave_size", None)
    return size if size is not None and layer.mok_config.expert_kind == "glu" else None


def _to_stock(module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: MoK names -> stock names, in place."""
    tp = _tp_group(module)
    for mok_name, stock_name in _RENAMED:
        if prefix + mok_name in state_dict:
            state_dict[prefix + stock_name] = state_dict.pop(prefix + mok_name)
            if stock_name.startswith("shared_experts.linear_fc"):  # the linears' extra state, not the gate's
                state_dict[prefix + stock_name.rsplit(".", 1)[0] + "." + _EXTRA] = None
            if tp is not None and stock_name in _SHARED_SPLIT_OVER_TP:
                whole = state_dict[prefix + stock_name]
                state_dict[prefix + stock_name] = _tp_part(
                    whole, _SHARED_SPLIT_OVER_TP[stock_name], tp.rank(), tp.size(), _split_as_glu(module, stock_name)
                )
    for mok_name, fc, leaf in _STACKED:
        stacked = state_dict.pop(prefix + mok_name, None)
        if stacked is None:
            continue
        for i in range(stacked.shape[0]):
            state_dict[f"{prefix}experts.local_experts.{i}.{fc}.{leaf}"] = stacked[i]
            state_dict[f"{prefix}experts.local_experts.{i}.{fc}.{_EXTRA}"] = None


def _from_stock(module, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: stock names (SequentialMLP or TEGroupedMLP) -> MoK names, in place."""
    for stale in _STALE:
        state_dict.pop(prefix + stale, None)
    tp = _tp_group(module)
    for mok_name, stock_name in _RENAMED:
        if prefix + stock_name in state_dict:
            value = state_dict.pop(prefix + stock_name)
            # Under TP, a plain state dict holds stock's TP parts; a distributed checkpoint, loaded
            # through megatron_sharded_state_dict, holds the whole tensors already.
            if tp is not None and stock_name in _SHARED_SPLIT_OVER_TP:
                whole = getattr(module.mok.shared_experts, mok_name.rsplit(".", 1)[1])
                if value.shape != whole.shape:
                    split = _SHARED_SPLIT_OVER_TP[stock_name]
                    value = _gather_tp_parts(value, split, tp, _split_as_glu(module, stock_name), whole.device)
            state_dict[prefix + mok_name] = value
    num_local = module.mok.experts.down_proj.shape[0]
    interleave = _glu_interleave_size(module)
    for mok_name, fc, leaf in _STACKED:
        param = _stacked_param(module, mok_name)
        if param is None:
            continue  # a stock bias this layer does not have stays an unexpected key
        # One expert's tensor: the stacked parameter minus its expert axis (fc1 weight [fc1 rows, H],
        # fc2 weight [H, I], fc1 bias [fc1 rows], fc2 bias [H]).
        expected = tuple(param.shape[1:])
        per_expert = []
        for i in range(num_local):
            for key in (f"{prefix}experts.local_experts.{i}.{fc}.{leaf}", f"{prefix}experts.{fc}.{leaf}{i}"):
                if key in state_dict:
                    weight = state_dict.pop(key)
                    found = tuple(getattr(weight, "shape", ()))
                    if found != expected:
                        # Caught here, by key: torch.stack would fail on the whole list, naming none.
                        raise RuntimeError(
                            f"size mismatch for {key}: the checkpoint has shape {list(found)}, this layer expects "
                            f"{list(expected)} (one expert's {fc} {leaf}: same hidden and expert FFN sizes and the "
                            "same gated or plain MLP needed)"
                        )
                    if interleave is not None and fc == "linear_fc1" and not key.startswith(f"{prefix}experts.local"):
                        weight = glu_deinterleave(weight, interleave)  # TEGroupedMLP's interleaved fc1 rows
                    per_expert.append(weight)
                    break
        if len(per_expert) == num_local:
            state_dict[prefix + mok_name] = torch.stack(per_expert)
        elif per_expert:
            raise KeyError(
                f"{prefix}experts: found {len(per_expert)} of {num_local} local experts' {fc} {leaf}s; "
                "the checkpoint's expert-parallel layout must match this layer's (same num_moe_experts and EP size)"
            )
    # Extra state the stock layers write (None for local layers, fp8 metadata for TE): MoK has none.
    extra = re.compile(re.escape(prefix) + r"(experts|shared_experts)\..*" + _EXTRA + r"\d*$")
    for key in [k for k in state_dict if extra.match(k)]:
        del state_dict[key]


def _stacked_param(module, mok_name: str) -> torch.Tensor | None:
    """The stacked expert parameter `mok_name` ("mok.experts.gate_up_bias"), or None when the
    layer's family has none."""
    return getattr(module.mok.experts, mok_name.rsplit(".", 1)[1])


def install_state_dict_hooks(layer: torch.nn.Module) -> None:
    """Make `layer.state_dict()` / `layer.load_state_dict()` speak the stock layer's keys."""
    layer.register_state_dict_post_hook(_to_stock)
    layer.register_load_state_dict_pre_hook(_from_stock)


def megatron_sharded_state_dict(layer, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
    """The layer's distributed-checkpoint state dict, sharded exactly as the stock layer's is.

    Args:
        layer: a MoKMoELayer (uses its `mok`, `pg_collection`, `num_local_experts`).
        prefix, sharded_offsets, metadata: as Megatron passes them to `sharded_state_dict`.
    """
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    dp_cp = metadata["dp_cp_group"]
    if metadata.get("singleton_local_shards", False):
        raise NotImplementedError(
            "MoKMoELayer checkpoints use Megatron's default expert sharding; singleton_local_shards "
            "(one key per expert) is not supported yet"
        )
    pg = layer.pg_collection
    plain = layer.state_dict(keep_vars=True)
    out: dict = {}

    def section(name: str) -> dict:
        return {k[len(name) + 1 :]: v for k, v in plain.items() if k.startswith(name + ".")}

    # Router (replicated) and its buffers, as MegatronModule's default does.
    out.update(make_sharded_tensors_for_checkpoint(section("router"), f"{prefix}router.", {}, sharded_offsets,
                                                   tp_group=pg.tp, dp_cp_group=dp_cp))  # fmt: skip
    gated = layer.mok_config.expert_kind == "glu"
    if layer.mok.shared_experts is not None:
        shared = section("shared_experts")
        # The parameters themselves: under TP, state_dict() holds copies of this rank's parts.
        for mok_name, stock_name in _RENAMED:
            param = getattr(layer.mok.shared_experts, mok_name.rsplit(".", 1)[1], None)
            if mok_name.startswith("mok.shared_experts.") and param is not None:
                shared[stock_name[len("shared_experts.") :]] = param
        # Stock splits its shared expert over TP; MoK holds it whole on every TP rank: the same global
        # tensors, saved as TP replicas (torch_dist reshards between the two layouts on load).
        out.update(
            _mlp_sharded(shared, f"{prefix}shared_experts.", sharded_offsets, pg.tp, dp_cp, gated, split_over_tp=False)
        )
        if "gate_weight" in shared:
            from megatron.core.utils import make_sharded_tensor_for_checkpoint

            key = f"{prefix}shared_experts.gate_weight"
            out[key] = make_sharded_tensor_for_checkpoint(
                shared["gate_weight"], key, prepend_offsets=sharded_offsets, tp_group=pg.tp, dp_cp_group=dp_cp
            )

    # Routed experts: the per-expert shards SequentialMLP writes (expert i along a new leading axis,
    # keys under "experts.experts."), built from MoK's stacked tensors by one factory per tensor,
    # so that Megatron's optimizer finds the parameter itself (it maps optimizer state by identity).
    experts = _stock_expert_shards(layer, plain, prefix, sharded_offsets, dp_cp, gated)
    # TEGroupedMLP's sharded fc1 tensors keep its interleaved rows (under SequentialMLP's keys).
    interleave = _glu_interleave_size(layer) if getattr(layer, "stock_experts", None) == "TEGroupedMLP" else None
    for mok_name, fc, leaf in _STACKED:
        param = _stacked_param(layer, mok_name)
        if param is None:
            continue
        shards = {k: v for k, v in experts.items() if k.endswith(f".{fc}.{leaf}")}
        out[prefix + mok_name] = _stacked_factory(param, shards, interleave if fc == "linear_fc1" else None)
    out.update({k: v for k, v in experts.items() if k.endswith(_EXTRA)})
    return out


def _stock_expert_shards(layer, plain: dict, prefix: str, sharded_offsets: tuple, dp_cp, gated: bool) -> dict:
    """{stock state-dict key: ShardedTensor / swiglu factory / ShardedObject}, as SequentialMLP makes them."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    pg = layer.pg_collection
    ep_rank, ep_size = pg.ep.rank(), pg.ep.size()
    num_local = layer.num_local_experts
    out: dict = {}
    for i in range(num_local):
        global_i = ep_rank * num_local + i
        local_prefix = f"{prefix}experts.local_experts.{i}."
        # SequentialMLP names its shards "<its prefix>experts.", under MoELayer's "experts.".
        sharded_prefix = f"{prefix}experts.experts."
        offsets = (*sharded_offsets, (len(sharded_offsets), global_i, num_local * ep_size))
        state = {k[len(local_prefix) - len(prefix) :]: v for k, v in plain.items()
                 if k.startswith(f"experts.local_experts.{i}.")}  # fmt: skip
        expert = _mlp_sharded(state, local_prefix, offsets, pg.expt_tp, dp_cp, gated)
        replace_prefix_for_sharding(expert, local_prefix, sharded_prefix)
        for sharded in expert.values():
            sharded.replica_id = (*sharded.replica_id[:2], pg.expt_dp.rank())
        out.update(expert)
    return out


def _stacked_factory(param: torch.Tensor, shards: dict, interleave: int | None = None):
    """One ShardedTensorFactory over a stacked [E_l, ...] parameter whose build gives the stock
    per-expert shards (for whatever tensor Megatron passes: the parameter or an optimizer state of
    its shape) and whose merge stacks the loaded experts back. interleave: fc1's rows are stored in
    TEGroupedMLP's blocks of that many rows (a copy on build, reordered back on merge)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    per_expert = [shards[k] for k in sorted(shards, key=lambda k: int(k.split(".local_experts.")[1].split(".")[0]))]

    def build(key: str, t: torch.Tensor, replica_id, flattened_range):
        # `key` is the factory's key as Megatron has it now: the transformer block strips layer
        # numbers from keys after the layer built them, and the optimizer prefixes its state names.
        if flattened_range is not None:
            raise NotImplementedError("MoK's expert checkpoints do not support flattened (distributed-optimizer "
                                      "fully-sharded) ranges yet")  # fmt: skip
        built = {}
        for i, shard in enumerate(per_expert):
            shard = copy.copy(shard)
            shard.data = t[i] if interleave is None else glu_interleave(t[i], interleave)
            parts = shard.build() if isinstance(shard, ShardedTensorFactory) else [shard]
            for part in parts:
                part.key = key  # every expert is a shard of one global tensor
            built[i] = list(parts)
        return built

    def merge(loaded: dict) -> torch.Tensor:
        experts = [torch.cat(loaded[i], dim=0) for i in range(len(per_expert))]
        if interleave is not None:
            experts = [glu_deinterleave(expert, interleave) for expert in experts]
        return torch.stack(experts)

    return ShardedTensorFactory(per_expert[0].key, param, build, merge, per_expert[0].replica_id)


def _mlp_sharded(
    state: dict, prefix: str, offsets: tuple, tp_group, dp_cp, gated: bool, split_over_tp: bool = True
) -> dict:
    """One MLP's sharded tensors, as Megatron's MLP and its linears build them: fc1 (column
    parallel) weight and bias along axis 0, fc2 (row parallel) weight along axis 1 and its bias
    replicated; a GLU's fc1 weight and bias through the SwiGLU factory. split_over_tp=False: the
    tensors are whole on every rank of tp_group (replicas of the same global tensors)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory as swiglu
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint as make

    out = {}
    for fc, axes in (("linear_fc1", {"weight": 0, "bias": 0}), ("linear_fc2", {"weight": 1})):
        axes = axes if split_over_tp else {}
        sub = {k[len(fc) + 1 :]: v for k, v in state.items() if k.startswith(fc + ".")}
        sharded = make(sub, f"{prefix}{fc}.", axes, offsets, tp_group=tp_group, dp_cp_group=dp_cp)
        if fc == "linear_fc1" and gated:
            for key in (f"{prefix}{fc}.weight", f"{prefix}{fc}.bias"):
                if key in sharded:
                    sharded[key] = swiglu(sharded[key], offsets, False, tp_group=tp_group, dp_group=dp_cp)
        out.update(sharded)
    return out
