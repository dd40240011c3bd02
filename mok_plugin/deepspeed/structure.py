"""The stock MoE layer's module structure over MoK's parameters: `layer.deepspeed_moe.gate.wg` and
`layer.deepspeed_moe.experts.deepspeed_experts[i]`, for code that reaches into DeepSpeed's layer
(MoE-LLaVA copying pretrained MLP weights into every expert and checking them, per-expert weight
reads of DeepSpeed's inference containers, gradient logging per expert).

Source of truth: MoK's parameters, the only ones the layer registers (`mok.router.weight`,
`mok.experts.gate_up_proj` [E_l, fc1 rows, H], ...; or, for experts that run as themselves, the
expert modules' own parameters). So `parameters()`, optimizer groups, DeepSpeed's expert tags
(`allreduce=False`, `group_name`), ZeRO's flattening and the state-dict hooks (checkpoint.py) see
each parameter once. `deepspeed_moe` is not a registered submodule: it adds no parameter, no
state-dict key and no module to `named_modules()`.

    deepspeed_moe.gate.wg                      MoK's router, the same nn.Linear (weight [E, H])
    deepspeed_moe.experts.deepspeed_experts    a recognised family (experts.py): one module per
                                               local expert, shaped as the expert given (its class,
                                               submodules and forward), whose weights are views
                                               expert modules (module_experts.py): MoK's
                                               `local_experts`, the same modules

A view module's tensors (`deepspeed_experts[i].gate_proj.weight`, ...) are not stored: each read
slices MoK's current stacked tensor (`gate_up_proj[i, :I]`), so it stays right after ZeRO or
`.to()` replace a parameter's storage. A read is a view of the same storage in autograd: a write
through it (`.data.copy_`, `.copy_` under no_grad) changes MoK's weights, a forward through the
view module gives MoK's parameters their gradients, and its `.grad` is the matching slice of MoK's
gradient (None before a backward). It carries DeepSpeed's expert tags. Assigning a tensor to the
attribute (`expert.gate_proj.weight = w`) copies w into MoK's weights; `state_dict()` and
`load_state_dict()` of a view module (or the ModuleList) speak the expert's own names.

One layout has no view: a fused first linear whose halves MoK stores swapped ([up; gate], GeGLU
style) is two slices of MoK's tensor in the other order, so a read of that weight (or bias) is a
copy in autograd; assignment and load_state_dict still write MoK's weights, in-place writes to
the copy do not. Replacing a module of the structure (`deepspeed_moe.gate = MyGate(...)`) is an
error: MoK would not run it. `.weight.data = w` on a view rebinds the data of a temporary and
cannot reach MoK; write with `.data.copy_(w)` or assign the attribute.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
from torch import nn

from mok_plugin.deepspeed.experts import ExpertLayout

__all__ = ["StockStructure", "build_stock_structure"]


class _Fixed(nn.Module):
    """Its submodules cannot be replaced: MoK's forward would not run a swapped-in gate or expert
    list (MoE-LLaVA's `deepspeed_moe.gate = KDTopKGate(...)`), so that is an error, not a no-op."""

    def __setattr__(self, name, value):
        if isinstance(value, nn.Module) and self.__dict__.get("_built"):
            raise TypeError(
                f"{type(self).__name__}.{name}: the stock MoE structure is a view of MoK's layer; replacing "
                "its modules would not change what MoK computes"
            )
        super().__setattr__(name, value)


class _GateView(_Fixed):
    """TopKGate's place: `wg` is MoK's router module itself."""

    def __init__(self, router: nn.Linear, k: int):
        super().__init__()
        self.wg = router
        self.k = k
        self._built = True


class _ExpertsView(_Fixed):
    """Experts' place: `deepspeed_experts[i]`, local expert i."""

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        self.deepspeed_experts = experts
        self.num_local_experts = len(experts)
        self._built = True


class StockStructure(_Fixed):
    """MOELayer's place (`layer.deepspeed_moe`): `gate`, `experts`, `l_aux`, `exp_counts`,
    `ep_group`, read from the MoK layer. Not callable: the layer's forward runs MoK."""

    def __init__(self, layer: nn.Module, experts: nn.ModuleList, k: int):
        super().__init__()
        self.gate = _GateView(layer.mok.router, k)
        self.experts = _ExpertsView(experts)
        self.ep_size, self.num_local_experts = layer.ep_size, layer.num_local_experts
        self.ep_group_name = layer.expert_group_name
        object.__setattr__(self, "_layer", layer)  # not a submodule (no cycle in named_modules)
        self._built = True

    @property
    def ep_group(self):
        return self._layer.mok.ep_group

    @property
    def _last(self):
        """The gate's last routing (gating.py's DeepSpeedGating), None before a forward."""
        return getattr(getattr(self._layer.mok, "routing_fn", None), "last", None)

    @property
    def l_aux(self) -> torch.Tensor | None:
        """The last forward's l_aux, as MOELayer.l_aux (None before a forward)."""
        return None if self._last is None else self._last.l_aux

    @property
    def exp_counts(self) -> torch.Tensor | None:
        """The last forward's exp_counts, as MOELayer.exp_counts (None before a forward)."""
        return None if self._last is None else self._last.exp_counts

    def forward(self, *args, **kwargs):
        raise TypeError("layer.deepspeed_moe is a view of MoK's weights; call the layer itself")


# --- expert views ------------------------------------------------------------------------------


def _pieces(layout: ExpertLayout, stock: str):
    return sorted((p for p in layout.pieces if p.stock == stock), key=lambda p: p.stock_start)


def _is_one_slice(pieces) -> bool:
    """The pieces are consecutive rows of one MoK tensor, in the same order."""
    first = pieces[0]
    return all(p.mok == first.mok and p.mok_start - first.mok_start == p.stock_start for p in pieces)


def _slices(experts: nn.Module, index: int, pieces, source) -> list[torch.Tensor]:
    return [source(getattr(experts, p.mok))[index, p.mok_start : p.mok_start + p.rows] for p in pieces]


def _read(owner: nn.Module, name: str) -> torch.Tensor:
    experts, index, pieces, group_name = owner.__dict__["_mok_views"][name]
    if _is_one_slice(pieces):
        rows = sum(p.rows for p in pieces)
        first = pieces[0]
        tensor = getattr(experts, first.mok)[index, first.mok_start : first.mok_start + rows]
        grad = getattr(experts, first.mok).grad
        has_grad = grad is not None
        if has_grad:
            tensor.grad = grad[index, first.mok_start : first.mok_start + rows]
    else:
        tensor = torch.cat(_slices(experts, index, pieces, lambda t: t))
        has_grad = all(getattr(experts, p.mok).grad is not None for p in pieces)
        if has_grad:
            tensor.grad = torch.cat(_slices(experts, index, pieces, lambda t: t.grad))
    if not has_grad and tensor.requires_grad and not tensor.is_leaf:
        tensor.retain_grad()  # .grad reads None without the non-leaf warning
    tensor.allreduce, tensor.group_name = False, group_name
    return tensor


def _write(owner: nn.Module, name: str, value: torch.Tensor) -> None:
    experts, index, pieces, _ = owner.__dict__["_mok_views"][name]
    rows = sum(p.rows for p in pieces)
    value = torch.as_tensor(value)
    width = getattr(experts, pieces[0].mok).shape[2:]
    if tuple(value.shape) != (rows, *width):
        raise ValueError(f"{name}: a tensor of shape {tuple(value.shape)} for a weight of shape {(rows, *width)}")
    with torch.no_grad():
        for p, target in zip(pieces, _slices(experts, index, pieces, lambda t: t), strict=True):
            target.copy_(value[p.stock_start : p.stock_start + p.rows])


def _state_dict_hook(owner, state_dict, prefix, local_metadata):
    for name in owner.__dict__["_mok_views"]:
        state_dict[prefix + name] = _read(owner, name).detach()  # as a module's own tensors are


def _load_hook(owner, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for name in owner.__dict__["_mok_views"]:
        key = prefix + name
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        try:
            _write(owner, name, state_dict.pop(key))
        except ValueError as error:
            error_msgs.append(f"size mismatch for {key}: {error}")


@functools.cache
def _view_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of the owner's class whose `names` are properties over MoK's tensors."""

    def setattr_(self, name, value):
        if name in self.__dict__.get("_mok_views", ()):
            _write(self, name, value)
        else:
            super(view, self).__setattr__(name, value)

    def reduce_ex(self, protocol):  # pickled and deep-copied as (the owner's class, names) + state
        return _new_view, (cls, names), self.__dict__

    attrs = {name: property(functools.partial(_read, name=name)) for name in names}
    attrs.update(
        __setattr__=setattr_, __reduce_ex__=reduce_ex, __module__=cls.__module__, __qualname__=cls.__qualname__
    )
    view = type(cls.__name__, (cls,), attrs)
    return view


def _new_view(cls: type, names: tuple[str, ...]) -> nn.Module:
    return object.__new__(_view_class(cls, names))


def _expert_view(expert: nn.Module, experts: nn.Module, index: int, layout: ExpertLayout, group_name: str) -> nn.Module:
    """A copy of `expert`'s modules without its tensors, whose weights read and write MoK's."""
    memo = {id(p): None for p in expert.parameters()}  # copy the structure, not the weights
    view = copy.deepcopy(expert, memo)
    owners: dict[str, list[str]] = {}
    for stock in layout.stock_names:
        owner, _, name = stock.rpartition(".")
        owners.setdefault(owner, []).append(name)
    for owner_name, names in owners.items():
        owner = view.get_submodule(owner_name)
        for name in names:
            del owner._parameters[name]
        object.__setattr__(
            owner, "_mok_views", {n: (experts, index, _pieces(layout, f"{owner_name}.{n}".lstrip(".")), group_name)
                                  for n in names}
        )  # fmt: skip
        owner.__class__ = _view_class(type(owner), tuple(names))
        owner.register_state_dict_post_hook(_state_dict_hook)
        owner.register_load_state_dict_pre_hook(_load_hook)
    return view


def build_stock_structure(layer: nn.Module, expert: nn.Module, layout: ExpertLayout | None, k: int) -> StockStructure:
    """`layer.deepspeed_moe` for a mok_plugin.deepspeed.MoE built from `expert` (module docstring)."""
    if layout is None:
        modules: Sequence[nn.Module] | nn.ModuleList = layer.mok.experts.local_experts
    else:
        modules = nn.ModuleList(
            _expert_view(expert, layer.mok.experts, i, layout, layer.expert_group_name)
            for i in range(layer.num_local_experts)
        )
    return StockStructure(layer, modules, k)
