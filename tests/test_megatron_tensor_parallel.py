"""Tensor parallelism with sequence parallelism (expert TP 1) in MoKMoELayer, on the CPU over gloo.

- Against the stock MoELayer at TP 2 with SP (2 processes): each rank routes its own sequence shard;
  outputs, input gradients, every parameter's gradient and the logged losses (aux loss and z-loss,
  whose token statistics Megatron reduces over TP x CP) match stock's; the replicated parameters are
  marked sequence-parallel, so finalize_model_grads sums their gradients over TP as it does stock's.
  With a shared expert (stock splits it over TP, MoK holds it whole): the same outputs, state dicts
  both ways, and Megatron's torch_dist checkpoints stock -> MoK -> stock.
- Topology invariance (4 processes): for each (TP, EP) layout with Megatron's own groups, every rank's
  output and input gradient, and its experts' weight gradients, are bitwise those of one process
  running its expert-parallel group's tokens (the sequence shards in group order), shared expert
  included; the replicated gradients add up over the group to the one-process gradient.
- Refusals: expert TP > 1 (Megatron's default when only TP is given) names --expert-tensor-parallel-size;
  training at TP > 1 without SP raises stock's own error."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from test_megatron import (  # noqa: E402, F401
    E,
    H,
    _config,
    _fwd_bwd,
    _init,
    megatron_world,
    stock_to_mok_to_stock,
    torch_dist_on_the_cpu,
)
from test_megatron_routing import _assert_same, _build  # noqa: E402

from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs, run_ranks  # noqa: E402

pytestmark = pytest.mark.megatron

S_LOCAL, B = 3, 2  # each rank's [S / TP, B, H] shard
SHARED = 24  # the shared expert's hidden size
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 4)]  # (TP, EP) on 4 ranks, expert TP 1


def _layout_config(tp: int, ep: int, **overrides):
    return _config(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=1, **overrides)  # fmt: skip


def _spec():
    return get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)


def _rank_tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s sequence shard and the probe its output is multiplied by."""
    x = make_layer_inputs(S_LOCAL * B, H, seed=100 + rank).view(S_LOCAL, B, H)
    probe = make_layer_inputs(S_LOCAL * B, H, seed=200 + rank).view(S_LOCAL, B, H)
    return x, probe


def _expert_grads(layer) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in layer.mok.named_parameters() if n.startswith("experts.")}


def _replicated_params(layer) -> dict[str, torch.nn.Parameter]:
    """The parameters every TP rank holds whole: router, shared experts (and their gate)."""
    return {n: p for n, p in layer.mok.named_parameters() if not n.startswith("experts.")}


def _replicated_grads(layer) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in _replicated_params(layer).items()}


# --- against the stock layer: TP 2 with SP, two processes ------------------------------------------


def _stock_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    parallel_state.destroy_model_parallel()
    torch_dist_on_the_cpu()  # also puts the stock router's buffers on the CPU
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
        losses = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
        for per_token in (False, True):
            cfg = _layout_config(2, 1, calculate_per_token_loss=per_token, **losses)
            stock, mok = _build(cfg)
            assert dist.get_world_size(mok.mok.sequence_group) == 2  # TP x CP
            _assert_same(stock, mok, seed=1000 * rank)  # each rank its own sequence shard
            # finalize_model_grads sums over TP the gradients of parameters marked sequence-parallel:
            # the router's in stock; in MoK every replicated one (router, and shared experts below).
            marked = {n for n, p in stock.named_parameters() if getattr(p, "sequence_parallel", False)}
            assert marked == {"router.weight"}
            assert all(getattr(p, "sequence_parallel", False) for p in _replicated_params(mok).values())
            assert not any(getattr(p, "sequence_parallel", False) for p in mok.mok.experts.parameters())
        _check_shared_expert(rank, losses)
        # Megatron's torch_dist checkpoints at TP 2, shared expert included: stock -> MoK -> stock.
        stock_to_mok_to_stock(_layout_config(2, 1, moe_shared_expert_intermediate_size=SHARED), out_dir)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _whole_over_tp(stock_state: dict, tp_group) -> dict:
    """The stock layer's state dict with its TP-split shared expert gathered whole (MoK's layout):
    each rank holds fc1 rows [gate_r; up_r] (a GLU) and fc2 columns r."""
    whole = dict(stock_state)
    for key in ("shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"):
        parts = [torch.empty_like(stock_state[key]) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, stock_state[key].contiguous(), group=tp_group)
        if key.endswith("fc1.weight"):
            gates, ups = zip(*(part.chunk(2) for part in parts), strict=True)
            whole[key] = torch.cat([*gates, *ups])
        else:
            whole[key] = torch.cat(parts, dim=1)
    return whole


def _global_tensors(sharded: dict) -> dict[str, torch.Tensor]:
    """What a distributed checkpoint of `sharded` holds: each key's global tensor, assembled from the
    main replicas of every rank's shards (factories built, as the save builds them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    pieces: list[ShardedTensor] = []
    stack = list(sharded.values())
    while stack:
        item = stack.pop()
        if isinstance(item, ShardedTensorFactory):
            stack.append(item.build())
        elif isinstance(item, dict | list | tuple):
            stack.extend(item.values() if isinstance(item, dict) else item)
        elif isinstance(item, ShardedTensor):
            pieces.append(item)
    tensors: dict[str, torch.Tensor] = {}
    for piece in pieces:
        whole = tensors.setdefault(piece.key, torch.zeros(piece.global_shape, dtype=piece.data.dtype))
        if not any(piece.replica_id if isinstance(piece.replica_id, tuple) else (piece.replica_id,)):
            whole[piece.global_slice()] += piece.data.detach()
    for key in sorted(tensors):
        dist.all_reduce(tensors[key])
    return tensors


def _check_shared_expert(rank: int, losses: dict) -> None:
    """TP 2 with a SwiGLU shared expert (stock splits it over TP; MoK holds it whole): state dicts
    both ways, the same outputs and input gradients, and distributed checkpoints that hold the same
    global tensors."""
    cfg = _layout_config(2, 1, moe_shared_expert_intermediate_size=SHARED, **losses)
    stock = _spec()(config=cfg)
    make_stock_router_cpu_safe(stock)
    mok = use_mok(_spec())(config=cfg)
    mok.load_state_dict(stock.state_dict())  # stock's TP parts, gathered whole by MoK's load hook
    whole = _whole_over_tp(stock.state_dict(), mok.pg_collection.tp)
    assert torch.equal(mok.mok.shared_experts.gate_up_proj, whole["shared_experts.linear_fc1.weight"])
    assert torch.equal(mok.mok.shared_experts.down_proj, whole["shared_experts.linear_fc2.weight"])
    # ... and written back as stock's parts: a stock layer loads MoK's state dict.
    again = _spec()(config=cfg)
    again.load_state_dict(mok.state_dict())
    for key, value in stock.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(again.state_dict()[key], value), f"state dict {key} back in stock"
    x, probe = _rank_tokens(rank)
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert_close(got[0], want[0], torch.float32, "output with a shared expert at TP 2")
    assert_close(got[1], want[1], torch.float32, "d_x with a shared expert at TP 2")
    stock_ckpt, mok_ckpt = _global_tensors(stock.sharded_state_dict()), _global_tensors(mok.sharded_state_dict())
    assert set(mok_ckpt) == set(stock_ckpt)
    assert any("shared_experts.linear_fc1" in key for key in stock_ckpt)
    for key, value in stock_ckpt.items():
        assert torch.equal(mok_ckpt[key], value), f"checkpoint tensor {key}"


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_with_sequence_parallel_matches_stock(tmp_path):
    run_ranks(_stock_worker, 2, args=(str(tmp_path),), timeout_s=240)


# --- topology invariance: every (TP, EP) layout against one process ---------------------------------


def _layout_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    parallel_state.destroy_model_parallel()
    full = torch.load(f"{out_dir}/weights.pt")
    results = {}
    try:
        for tp, ep in LAYOUTS:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
            )
            cfg = _layout_config(tp, ep, moe_shared_expert_intermediate_size=SHARED,
                                 moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)  # fmt: skip
            layer = use_mok(_spec())(config=cfg)
            ep_group = layer.pg_collection.ep
            mine = slice(dist.get_rank(ep_group) * (E // ep), (dist.get_rank(ep_group) + 1) * (E // ep))
            with torch.no_grad():
                for name, param in layer.mok.named_parameters():
                    param.copy_(full[name][mine] if name.startswith("experts.") else full[name])
            x, probe = _rank_tokens(rank)
            out, d_x, _ = _fwd_bwd(layer, x, probe)
            stock = _spec()(config=cfg)
            results[(tp, ep)] = {
                # Megatron's `allreduce` mark (expert groups for gradients and optimizer), MoK's and stock's.
                "allreduce": ({p.allreduce for p in layer.mok.experts.parameters()},
                              {getattr(p, "allreduce", True) for p in stock.experts.parameters()}),
                "ep_ranks": dist.get_process_group_ranks(ep_group),
                "tp_ranks": dist.get_process_group_ranks(layer.pg_collection.tp),
                "out": out, "d_x": d_x, "experts": _expert_grads(layer), "replicated": _replicated_grads(layer),
            }  # fmt: skip
            parallel_state.destroy_model_parallel()
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.usefixtures("megatron_world")
def test_tensor_and_expert_parallel_layouts_are_bitwise_one_process(tmp_path):
    cfg = _config(moe_shared_expert_intermediate_size=SHARED, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0)  # fmt: skip
    one = use_mok(_spec())(config=cfg)
    torch.save({n: p.detach().clone() for n, p in one.mok.named_parameters()}, tmp_path / "weights.pt")
    run_ranks(_layout_worker, 4, args=(str(tmp_path),), timeout_s=400)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for tp, ep in LAYOUTS:
        for rank, result in enumerate(r[(tp, ep)] for r in ranks):
            where = f"TP {tp} x EP {ep}, rank {rank}"
            group = result["ep_ranks"]
            assert len(group) == ep and len(result["tp_ranks"]) == tp, where
            assert result["allreduce"][0] == result["allreduce"][1] == {False}, f"{where}: expert params' allreduce"
            # One process, the expert-parallel group's tokens: its ranks' shards in group order.
            shards = [_rank_tokens(g) for g in group]
            x = torch.cat([s[0] for s in shards])
            probe = torch.cat([s[1] for s in shards])
            one.zero_grad(set_to_none=True)
            out, d_x, _ = _fwd_bwd(one, x, probe)
            mine = slice(group.index(rank) * S_LOCAL, (group.index(rank) + 1) * S_LOCAL)
            assert torch.equal(result["out"], out[mine]), f"{where}: output"
            assert torch.equal(result["d_x"], d_x[mine]), f"{where}: input gradient"
            E_l = E // ep
            for name, grad in _expert_grads(one).items():
                local = grad[group.index(rank) * E_l : (group.index(rank) + 1) * E_l]
                assert torch.equal(result["experts"][name], local), f"{where}: {name} gradient"
            # Replicated parameters: each rank's gradient covers its own shard; over the group they
            # add up (in another order: closely) to the one-process gradient.
            for name, grad in _replicated_grads(one).items():
                total = sum(ranks[g][(tp, ep)]["replicated"][name].double() for g in group)
                assert_close(total, grad, torch.float32, f"{where}: {name} gradient", n_reduce=64 * ep)


# --- refusals ----------------------------------------------------------------------------------------


def test_expert_tensor_parallelism_is_refused_by_name():
    # Megatron makes expert TP equal to TP when --expert-tensor-parallel-size is not given.
    cfg = _config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert cfg.expert_tensor_parallel_size == 2
    with pytest.raises(MoKConfigError, match="--expert-tensor-parallel-size"):
        mok_config_from_megatron(cfg)
    mok_config_from_megatron(_layout_config(2, 1))  # expert TP 1: accepted


def test_shared_expert_size_must_split_over_tp():
    # Stock's TP-split shared expert refuses it (ColumnParallelLinear); MoK writes stock's TP parts.
    mok_config_from_megatron(_layout_config(2, 1, moe_shared_expert_intermediate_size=24))
    with pytest.raises(MoKConfigError, match="--moe-shared-expert-intermediate-size"):
        mok_config_from_megatron(_layout_config(4, 1, moe_shared_expert_intermediate_size=10))


def _no_sp_worker(rank: int, world: int, port: int) -> None:
    _init(rank, world, port)
    parallel_state.destroy_model_parallel()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
        cfg = _config(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
        layer = use_mok(_spec())(config=cfg)
        x, _ = _rank_tokens(0)
        with pytest.raises(ValueError, match="without also enabling sequence parallelism"):
            layer(x)
        layer.eval()  # evaluation without SP runs, as in stock: every TP rank routes the same tokens
        layer(x)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_training_without_sequence_parallelism_raises_stocks_error():
    run_ranks(_no_sp_worker, 2, timeout_s=120)
