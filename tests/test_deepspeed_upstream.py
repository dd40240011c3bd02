# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

"""DeepSpeed's own MoE tests, run with MoK substituted (issue 22, "How it is shown").

Source: deepspeedai/DeepSpeed, tests/unit/v1/moe/test_moe.py at commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (the mirror's newest commit; test_moe.py last changed in
619e3199d, and test_moe.py, simple_model.py and common.py are the same at tag v0.19.5; the mirror has
no v0.19.8 tag). Apache-2.0: the header above is DeepSpeed's and covers the copied test bodies; the
models and loaders are in tests/deepspeed_upstream_models.py. Each test names the test it copies.

What changed, and only that:
  * DeepSpeed's `DistributedTest` harness becomes `_run_ranks`: spawned processes that set the
    variables DistributedTest sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE = world size, as the
    CPU accelerator expects, MASTER_*) and call `deepspeed.init_distributed` with the accelerator's
    backend (gloo on the CPU).
  * MoK is substituted with `mok_plugin.deepspeed.apply(ds_config)` and an enabled "mok" block (the
    models keep calling `deepspeed.moe.layer.MoE(...)`), or by building `mok_plugin.deepspeed.MoE`
    where the test builds one layer.
  * fp16 cases need a GPU: they are kept as copied, marked gpu and skipped without CUDA. Their
    fp32 CPU variants (`*_fp32_cpu`) run the same bodies with fp16 off.
  * The tests that count DeepSpeed's all-to-all (`sharded_moe._AllToAll`) or its capacity
    all-reduce count MoK's exchange instead (`mok_plugin.parallel.dispatch._AllToAll`, the
    collectives of torch.distributed).
  * DeepSpeed's gate-function tests (top1gating/top2gating/topkgating called directly) run through
    the MoE layer, MoK's against the stock one with the same weights: MoK has no gate functions.
  * The CPU variants train on CPU_SAMPLES = 4 samples instead of 50.
  * A config optimizer "Adam" gets "torch_adam": true on the CPU (DeepSpeed's FusedAdam would be
    JIT-compiled, about 70 s).
Not copied: TestTopkGate's sparse-route tests (`_route_slots`, `_sparse_encode`, `_sparse_decode`:
DeepSpeed's dispatcher internals, which MoK replaces) and test_top1gating_preserves_tensor_parallel_capacity
(expert tensor parallelism, which MoK does not implement).
"""

# ruff: noqa: B007, B905 (copied DeepSpeed code keeps its loops as written)

import contextlib
import datetime
import gc
import os
import random

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

import deepspeed.comm as dist  # noqa: E402
import deepspeed.moe.sharded_moe as sharded_moe  # noqa: E402
from deepspeed import get_accelerator  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed_upstream_models import SimpleMoEModel, SimplePRMoEModel, sequence_dataloader  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
import mok_plugin.parallel.dispatch as mok_dispatch  # noqa: E402
from mok_plugin.parallel.gloo_cuda import run_collectives_one_by_one  # noqa: E402
from mok_plugin.testing import assert_close, free_port, run_ranks  # noqa: E402

pytestmark = pytest.mark.deepspeed
CUDA = torch.cuda.is_available()
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="fp16 DeepSpeed MoE tests need a CUDA device")]
# On the CPU the reference backend: the Triton interpreter would be slow.
MOK_BLOCK = {"enabled": True} if CUDA else {"enabled": True, "backend": "reference"}
# The CPU variants train on 4 samples, not 50 (time: the whole file within ~90 s on 2 cores).
CPU_SAMPLES = 4
SOURCE = "deepspeedai/DeepSpeed@edaa7221267243c7be7fb49c5d5f5c4fb97b4641:tests/unit/v1/moe/test_moe.py"


# --- the harness: DeepSpeed's DistributedTest, reduced to spawned gloo (or nccl) ranks ---------------


def _rank_main(rank: int, world: int, port: int, body, kwargs: dict) -> None:
    # What tests/unit/common.py DistributedTest._dist_run sets.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      LOCAL_SIZE=str(world), WORLD_SIZE=str(world))  # fmt: skip
    backend = get_accelerator().communication_backend_name()
    if get_accelerator().is_available() and CUDA:
        gpus = torch.cuda.device_count()
        if world > gpus:
            # Not in DeepSpeed's harness, which gives each rank its own GPU: NCCL refuses two ranks on
            # one GPU, so on fewer GPUs than ranks the ranks share them (LOCAL_RANK names the GPU, for
            # DeepSpeed's engine and init_process_group) over gloo, which moves CUDA tensors through
            # the host. The models, configs and assertions are unchanged.
            os.environ["LOCAL_RANK"] = str(rank % gpus)
            backend = "gloo"
            # Started here, without the device_id DeepSpeed would bind (then torch splits every new
            # group from the default one, which gloo cannot); init_distributed keeps this group.
            torch.distributed.init_process_group(backend, rank=rank, world_size=world,
                                                 timeout=datetime.timedelta(seconds=60))
            run_collectives_one_by_one()  # gloo's coalesced all-reduce takes no CUDA tensors
        get_accelerator().set_device(rank % gpus)
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    body(**kwargs)
    dist.barrier()


def _run_ranks(world: int, body, **kwargs) -> None:
    """body(**kwargs) on `world` spawned ranks; a rank's exception fails the test with its traceback."""
    run_ranks(_rank_main, world, args=(body, kwargs), timeout_s=240)


@contextlib.contextmanager
def _mok(config_dict: dict | None = None):
    """MoK substituted: config_dict gets the "mok" block, and apply() switches DeepSpeed's MoE to MoK."""
    if config_dict is not None:
        config_dict["mok"] = dict(MOK_BLOCK)
    assert mds.apply({"mok": dict(MOK_BLOCK)}) is True
    try:
        yield
    finally:
        mds.revert()


def _cpu_config(config_dict: dict) -> dict:
    """The CPU variant of a copied config: fp32 (fp16 off), and torch's Adam for a config "Adam"."""
    config_dict = dict(config_dict)
    config_dict.pop("fp16", None)
    if config_dict.get("optimizer", {}).get("type") == "Adam" and not CUDA:
        params = {**config_dict["optimizer"]["params"], "torch_adam": True}
        config_dict["optimizer"] = {"type": "Adam", "params": params}
    return config_dict


def _assert_is_mok(model) -> None:
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(isinstance(m, mds.MoE) for m in layers), [type(m) for m in layers]


# --- TestSimpleMoE ----------------------------------------------------------------------------------


def _simple_moe_body(zero_stage: int, fp16: bool) -> None:
    """Copied from TestSimpleMoE.test (test_moe.py, SOURCE); MoK through apply()."""
    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.00015
            }
        },
        "fp16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": zero_stage
        }
    }  # fmt: skip
    dtype = torch.float16
    if not fp16:
        config_dict, dtype = _cpu_config(config_dict), torch.float32
    with _mok(config_dict):
        # should automatically create moe param groups in deepspeed backend
        hidden_dim = 16
        model = SimpleMoEModel(hidden_dim=hidden_dim, ep_size=1)
        _assert_is_mok(model)
        model, optimizer, _, _ = deepspeed.initialize(config=config_dict, model=model)
        data_loader = sequence_dataloader(model=model,
                                          total_samples=50 if fp16 else CPU_SAMPLES,
                                          hidden_dim=hidden_dim,
                                          device=model.device,
                                          dtype=dtype)  # fmt: skip

        for n, batch in enumerate(data_loader):
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("fp16", [pytest.param(True, marks=needs_gpu, id="fp16"), pytest.param(False, id="fp32_cpu")])
def test_simple_moe(zero_stage, fp16):
    """TestSimpleMoE (world size 2, EP = 1, two MoE layers, k = 1, use_rts and drop_tokens at
    DeepSpeed's defaults) with MoK: 50 steps train."""
    _run_ranks(2, _simple_moe_body, zero_stage=zero_stage, fp16=fp16)


# --- TestMoE ----------------------------------------------------------------------------------------


def _moe_body(ep_size: int, zero_stage: int, use_residual: bool, fp16: bool) -> None:
    """Copied from TestMoE.test (test_moe.py, SOURCE); MoK through apply()."""
    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "fp16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": zero_stage
        }
    }  # fmt: skip
    dtype = torch.float16
    if not fp16:
        config_dict, dtype = _cpu_config(config_dict), torch.float32
    with _mok(config_dict):
        hidden_dim = 16

        # E+D -- ep_size = 2
        # E only -- ep_size = 4
        model = SimpleMoEModel(hidden_dim, ep_size=ep_size, use_residual=use_residual)
        _assert_is_mok(model)
        param_group = {'params': [p for p in model.parameters()], 'name': 'random-unique-name'}
        params = split_params_into_different_moe_groups_for_optimizer(param_group)
        optimizer = torch.optim.AdamW(params=params)
        model, optimizer, _, _ = deepspeed.initialize(config=config_dict,
                                                      model=model,
                                                      optimizer=optimizer,
                                                      dist_init_required=False)  # fmt: skip
        #dist_init_required=False -- parameterize to True/False?

        data_loader = sequence_dataloader(model=model,
                                          total_samples=50 if fp16 else CPU_SAMPLES,
                                          hidden_dim=hidden_dim,
                                          device=model.device,
                                          dtype=dtype)  # fmt: skip

        def strict_average_tensor(tensor, communication_data_type: torch.dtype):
            process_group = optimizer.dp_process_group
            curr_size = 0
            pg_offsets = []

            ipg_bucket = optimizer.ipg_buckets[communication_data_type]
            for i, param_idx, param_id in ipg_bucket.params:
                param = optimizer.bit16_groups[i][param_idx]
                process_group = optimizer.dp_process_group
                if ipg_bucket.has_moe_params:
                    process_group = optimizer.expert_dp_process_group[param.group_name] if is_moe_param(
                        param) else optimizer.dp_process_group
                partition_ids = optimizer.param_to_partition_ids[i][param_id]
                # Get all partition ids + their offsets
                partition_offsets = []
                for partition_id in partition_ids:
                    offset = optimizer.grad_start_offset[i][partition_id][param_id]
                    partition_offsets.append(offset)
                partition_offsets.sort()
                # Calculate rank and offsets for grad slices
                for idx, offset in enumerate(partition_offsets):
                    # Calculate numel for grad slice depending on partition location
                    if idx == len(partition_offsets) - 1:
                        # Last partition_id uses its own offset
                        numel = param.numel() - offset
                    else:
                        # Set numel to next partition's offset
                        numel = partition_offsets[idx + 1] - offset
                    pg_offsets.append((curr_size, process_group))
                    curr_size += numel

            def strict_narrow(dim, start, length):
                lo, hi = 0, len(pg_offsets) - 1
                while lo < hi:
                    mi = lo + (hi - lo) // 2
                    if pg_offsets[mi][0] >= start:
                        hi = mi
                    else:
                        lo = mi + 1
                curr_slice, reduce_process_group = lo, pg_offsets[lo][1]
                while curr_slice < len(pg_offsets) and start + length > pg_offsets[curr_slice][0]:
                    assert reduce_process_group == pg_offsets[curr_slice][
                        1], "reduce process_group does not match the parameter's process_group"
                    curr_slice += 1
                return orig_narrow(dim, start, length)  # real call

            orig_narrow, tensor.narrow = tensor.narrow, strict_narrow
            type(optimizer).average_tensor(optimizer, tensor, communication_data_type)  # real call
            tensor.narrow = orig_narrow

        if "average_tensor" in dir(optimizer):
            optimizer.average_tensor = strict_average_tensor

        for n, batch in enumerate(data_loader):
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            assert torch.isfinite(loss)
            gc.collect()  # Must do this or we get a memory leak in this test


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("use_residual", [True, False])
@pytest.mark.parametrize("fp16", [pytest.param(True, marks=needs_gpu, id="fp16")])
def test_moe(ep_size, zero_stage, use_residual, fp16):
    """TestMoE as copied: world size 4, EP = 2 (E+D) and 4 (E only), ZeRO 0/1/2, Residual-MoE on/off,
    the strict average_tensor check of ZeRO-2's expert-data-parallel reduction; MoK trains."""
    _run_ranks(4, _moe_body, ep_size=ep_size, zero_stage=zero_stage, use_residual=use_residual, fp16=fp16)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "ep_size, zero_stage, use_residual",
    # Two of TestMoE's 12 cases (the CPU time budget): each EP size, ZeRO-2 (the strict
    # average_tensor check) and ZeRO-1, residual off and on.
    [(2, 2, False), (4, 1, True)],
)
def test_moe_fp32_cpu(ep_size, zero_stage, use_residual):
    """TestMoE's body in fp32 on the CPU (world size 4, gloo)."""
    _run_ranks(4, _moe_body, ep_size=ep_size, zero_stage=zero_stage, use_residual=use_residual, fp16=False)


# --- TestPRMoE --------------------------------------------------------------------------------------


def _prmoe_body(ep_size: int, use_residual: bool, fp16: bool) -> None:
    """Copied from TestPRMoE.test (test_moe.py, SOURCE); MoK through apply()."""
    config_dict = {"train_batch_size": 8, "steps_per_print": 1, "fp16": {"enabled": True}}
    dtype = torch.float16
    if not fp16:
        config_dict, dtype = _cpu_config(config_dict), torch.float32
    with _mok(config_dict):
        hidden_dim = 16

        # E+D -- ep_size = 2
        # E only -- ep_size = 4
        model = SimplePRMoEModel(hidden_dim, ep_size=ep_size, use_residual=use_residual)
        _assert_is_mok(model)
        optimizer = torch.optim.AdamW(params=model.parameters())
        model, _, _, _ = deepspeed.initialize(config=config_dict,
                                              model=model,
                                              optimizer=optimizer,
                                              dist_init_required=False)  # fmt: skip

        data_loader = sequence_dataloader(model=model,
                                          total_samples=50 if fp16 else CPU_SAMPLES,
                                          hidden_dim=hidden_dim,
                                          device=model.device,
                                          dtype=dtype)  # fmt: skip

        for n, batch in enumerate(data_loader):
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ep_size, use_residual", [(2, True), (2, False)])
@pytest.mark.parametrize("fp16", [pytest.param(True, marks=needs_gpu, id="fp16"), pytest.param(False, id="fp32_cpu")])
def test_prmoe(ep_size, use_residual, fp16):
    """TestPRMoE: world size 4, pyramid-residual MoE (2 then 4 experts), EP = 2; MoK trains."""
    _run_ranks(4, _prmoe_body, ep_size=ep_size, use_residual=use_residual, fp16=fp16)


# --- TestTopk: uneven token counts across ranks ------------------------------------------------------


def _pair(H: int, E: int, **kwargs):
    """A stock layer with distinct random experts, and a MoK layer with its weights."""
    torch.manual_seed(0)
    stock = MoE(hidden_size=H, expert=torch.nn.Linear(H, H), num_experts=E, **kwargs)
    with torch.no_grad():  # distinct experts (DeepSpeed starts them as copies of one)
        for p in stock.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    mok = mds.MoE(hidden_size=H, expert=torch.nn.Linear(H, H), num_experts=E, **kwargs)
    mok.load_state_dict(stock.state_dict())
    return stock, mok


def _topk_body() -> None:
    """Adapted from TestTopk.test (test_moe.py, SOURCE): there, top1gating runs with 2 tokens on
    rank 0 and 10 on rank 1 (use_rts=True, drop_tokens=False). Here the same through MoK's layer with
    the 2 experts spread over the 2 ranks (EP = 2), against the stock layer at EP = 1 with the same
    weights (dropless, so the random token selection cannot change the result).

    Not against the stock layer at EP = 2: DeepSpeed 0.19.8's dropless top1gating takes the MAX of
    the expert counts over the EP group, then clamps it to the rank's own token count, so ranks with
    2 and 10 tokens size their all-to-all differently and gloo aborts ("Received data size doesn't
    match expected size", 320 vs 64 bytes)."""
    device = get_accelerator().current_device_name()
    H, rank = 8, dist.get_rank()
    stock, _ = _pair(H, 2, ep_size=1, k=1, min_capacity=0, drop_tokens=False, use_rts=True)
    mok = mds.MoE(hidden_size=H, expert=torch.nn.Linear(H, H), num_experts=2, ep_size=2, k=1, min_capacity=0,
                  drop_tokens=False, use_rts=True)  # fmt: skip
    mok.set_deepspeed_parallelism()
    # Expert `rank` of EP = 1 is this rank's expert 0 at EP = 2 (as get_state_dict_ep2 below maps it).
    state = {key: value for key, value in stock.state_dict().items() if "deepspeed_experts" not in key}
    for name in ("weight", "bias"):
        state[f"deepspeed_moe.experts.deepspeed_experts.0.{name}"] = stock.state_dict()[
            f"deepspeed_moe.experts.deepspeed_experts.{rank}.{name}"]  # fmt: skip
    mok.load_state_dict(state)
    torch.manual_seed(1 + rank)
    if dist.get_rank() == 0:
        x = torch.rand(2, H, device=device)
    elif dist.get_rank() == 1:
        x = torch.rand(10, H, device=device)
    want, want_aux, _ = stock(x)
    out, aux, _ = mok(x)
    assert_close(out, want, torch.float32, f"output rank {rank}")
    # DeepSpeed's gate computes l_aux from the rank's own tokens at every EP size.
    assert_close(aux, want_aux, torch.float32, f"l_aux rank {rank}")


@pytest.mark.slow
@pytest.mark.distributed
def test_topk():
    """TestTopk: world size 2, MoK at EP = 2 with 2 and 10 tokens; outputs against the stock layer at
    EP = 1 with the same weights: outputs and l_aux."""
    _run_ranks(2, _topk_body)


# --- TestMoESingleton ---------------------------------------------------------------------------------


def _all_to_all_body(ep_size: int, expected_calls: int) -> None:
    """Copied from TestMoESingleton.test_all_to_all (test_moe.py, SOURCE), counting MoK's exchange.

    DeepSpeed's test replaces `sharded_moe._AllToAll.apply` by the identity and expects 0 calls at
    EP = 1 (a one-rank group needs no exchange) and 2 at EP = 2 (dispatch and combine). MoK's
    exchange is `mok_plugin.parallel.dispatch._AllToAll` (the differentiable row all-to-all; the
    per-rank counts go through one plain all_to_all_single). Here it is wrapped, not replaced: the
    identity would hand the experts rows of the wrong length (MoK sizes its exchange exactly). In
    one forward at EP = 2 it runs 3 times (the token rows and their routing weights out, the
    results back), and 3 more in the backward (their gradients), so calls made with grad enabled
    (the forward) and without (autograd's backward) are counted apart. DeepSpeed's own
    `_AllToAll` must not run at all."""
    config_dict = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1}
    hidden_dim = 8
    expert = torch.nn.Sequential(torch.nn.Linear(hidden_dim, hidden_dim), torch.nn.Linear(hidden_dim, hidden_dim))
    with _mok(config_dict):
        model = MoE(hidden_size=hidden_dim, expert=expert, num_experts=2, ep_size=ep_size, k=1, min_capacity=0)
    assert isinstance(model, mds.MoE)
    optimizer = torch.optim.AdamW(params=model.parameters())
    model, _, _, _ = deepspeed.initialize(config=config_dict,
                                          model=model,
                                          optimizer=optimizer,
                                          dist_init_required=False)  # fmt: skip

    forward_calls, backward_calls, deepspeed_calls = [], [], []
    original_apply = mok_dispatch._AllToAll.apply

    def counted_all_to_all(t, send_splits, recv_splits, group):
        (forward_calls if torch.is_grad_enabled() else backward_calls).append((group, t.shape))
        return original_apply(t, send_splits, recv_splits, group)  # real call

    def deepspeed_all_to_all(group, input):
        deepspeed_calls.append((group, input.shape))
        return input

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(mok_dispatch._AllToAll, "apply", counted_all_to_all)
        monkeypatch.setattr(sharded_moe._AllToAll, "apply", deepspeed_all_to_all)

        x = torch.randn(1, 4, hidden_dim, device=model.device, requires_grad=True)
        output, l_aux, _ = model(x)
        assert len(forward_calls) == expected_calls
        assert not backward_calls and not deepspeed_calls

        loss = output.float().sum() + l_aux.float()
        model.backward(loss)
        assert len(forward_calls) == expected_calls
        assert len(backward_calls) == expected_calls
        assert not deepspeed_calls
        assert x.grad is not None
        assert any(param.grad is not None for param in model.module.parameters())
        ep_group = model.module.mok.ep_group
        assert all(group is ep_group for group, _ in forward_calls + backward_calls)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ep_size, expected_calls", [(1, 0), (2, 3)], ids=["single", "multi"])
def test_all_to_all(ep_size, expected_calls):
    """TestMoESingleton.test_all_to_all: world size 2; MoK's row exchange runs 0 times at EP = 1 and
    3 times a forward (3 more in the backward) at EP = 2 (DeepSpeed: 0 and 2)."""
    _run_ranks(2, _all_to_all_body, ep_size=ep_size, expected_calls=expected_calls)


COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather", "broadcast")


def _capacity_body() -> None:
    """Adapted from TestMoESingleton.test_capacity (test_moe.py, SOURCE).

    DeepSpeed's test calls top1/top2/topk gating dropless with an EP group of 1 or 2 ranks and counts
    the all-reduce (MAX) that sizes the dropless capacity: none for a one-rank group, one over the
    group otherwise. MoK has no such all-reduce (its dropless exchange is sized by the exchanged
    counts), so this counts every torch.distributed collective in a dropless forward of MoK's layer
    for k = 1, 2, 3: none at EP = 1, and at EP = 2 only collectives over the EP group, none of them
    a MAX all-reduce."""
    H, E = 8, 4
    cases = [(1, False, k) for k in (1, 2, 3)] + [(2, True, k) for k in (1, 2, 3)]  # "single", then "multi"
    for ep_world_size, expected_collectives, k in cases:
        calls = []
        originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}

        def counted(name, calls=calls, originals=originals):
            def call(*args, **kwargs):
                calls.append((name, kwargs.get("group"), kwargs.get("op")))
                return originals[name](*args, **kwargs)

            return call

        _, mok = _pair(H, E, ep_size=ep_world_size, k=k, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False)  # fmt: skip
        mok.set_deepspeed_parallelism()
        logits_input = torch.randn(8, H)
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in COLLECTIVES:
                monkeypatch.setattr(torch.distributed, name, counted(name))
            mok(logits_input)
        if not expected_collectives:
            assert calls == [], (k, calls)
        else:
            assert calls, k
            ep_group = mok.mok.ep_group
            assert all(group is ep_group for _, group, _ in calls), (k, calls)
            assert all(op != torch.distributed.ReduceOp.MAX for _, _, op in calls), (k, calls)


@pytest.mark.slow
@pytest.mark.distributed
def test_capacity():
    """TestMoESingleton.test_capacity through MoK's layer: world size 2, the "single" (EP = 1) and
    "multi" (EP = 2) cases with k = 1, 2, 3, in one run (one spawn)."""
    _run_ranks(2, _capacity_body)


def test_no_ep_group(monkeypatch):
    """Adapted from TestMoESingleton.test_no_ep_group (test_moe.py, SOURCE): without an EP group
    (EP = 1) no collective code runs; here MoK's layer (k = 2, dropless) in one process, forward and
    backward, with torch.distributed's world size and all-reduce made to fail."""

    def fail_collective(*args, **kwargs):
        raise AssertionError("ep_group=None should not enter expert-parallel collective code")

    H, E = 8, 4
    layer = mds.MoE(hidden_size=H, expert=torch.nn.Linear(H, H), num_experts=E, k=2, drop_tokens=False,
                    top2_2nd_expert_sampling=False)  # fmt: skip
    monkeypatch.setattr(torch.distributed, "get_world_size", fail_collective)
    monkeypatch.setattr(torch.distributed, "all_reduce", fail_collective)
    monkeypatch.setattr(sharded_moe.dist, "get_world_size", fail_collective)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", fail_collective)

    device = get_accelerator().current_device_name()
    logits_input = torch.randn(8, H, device=device, requires_grad=True)
    out, l_aux, _ = layer(logits_input)
    (out.sum() + l_aux).backward()
    assert logits_input.grad is not None


# --- TestTopkGate.test and the capacity tests, through the layer ------------------------------------


@pytest.fixture(scope="module")
def ds_world():
    """A one-rank world: DeepSpeed's stock layer asks deepspeed.comm for its group sizes."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    if not torch.distributed.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))  # fmt: skip
        deepspeed.init_distributed(dist_backend="gloo")
        yield
        torch.distributed.destroy_process_group()
    else:
        yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _logits_pair(logits: torch.Tensor, k: int, **kwargs):
    """Stock and MoK layers whose router gives exactly `logits` for x = logits (wg = identity, H = E)."""
    S, E = logits.shape
    stock, mok = _pair(E, E, k=k, use_rts=False, top2_2nd_expert_sampling=False, **kwargs)
    with torch.no_grad():
        stock.deepspeed_moe.gate.wg.weight.copy_(torch.eye(E))
    mok.load_state_dict(stock.state_dict())
    return stock, mok


def _compare_layers(stock, mok, x: torch.Tensor, what: str) -> None:
    x_stock, x_mok = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, want_aux, want_counts = stock(x_stock)
    out, aux, counts = mok(x_mok)
    assert_close(out, want, torch.float32, f"{what}: output")
    assert torch.equal(counts.to(want_counts.dtype), want_counts), (what, counts, want_counts)
    (want.sum()).backward()
    (out.sum()).backward()
    assert_close(x_mok.grad, x_stock.grad, torch.float32, f"{what}: d_x")


# TestTopkGate.test's logits (s=4 tokens, e experts). Through the layer, k = 2 runs DeepSpeed's
# top2gating and k = 3 its topkgating with the layer's drop policy ("probs"): that test's
# "position" dispatch masks are not reachable through MoE(...).
TOPK_GATE_CASES = [
    # s=4 e=4 topk=2 cap=2(s*topk/e)
    pytest.param(
        [[0.11, 0.2, 0.1, 0.3], [0.3, 0.4, 0.11, 0.1], [0.11, 0.1, 0.6, 0.5], [0.1, 0.11, 0.7, 0.8]],
        2, True, id="s4_e4_top2_drop"),
    # s=4 e=6 topk=3 cap=2(s*topk/e): the "probs" policy keeps each expert's highest-probability
    # tokens (expert 5 keeps tokens 1 and 3, not 0 and 1).
    pytest.param(
        [[0.5858, 0.4801, 0.6269, 0.5397, 0.9722, 0.7034], [0.5445, 0.6332, 0.4519, 0.6308, 0.0519, 0.6450],
         [0.4874, 0.8110, 0.7467, 0.8474, 0.0277, 0.3068], [0.8570, 0.6714, 0.5310, 0.3274, 0.4836, 0.9892]],
        3, True, id="s4_e6_top3_drop"),
    # s=4 e=4 topk=2 drop_tokens=False
    pytest.param(
        [[0.95, 0.85, 0.90, 0.80], [0.70, 0.65, 0.75, 0.60], [0.50, 0.55, 0.45, 0.40], [0.35, 0.30, 0.25, 0.20]],
        2, False, id="s4_e4_top2_dropless"),
]  # fmt: skip


@pytest.mark.parametrize("logits, k, drop_tokens", TOPK_GATE_CASES)
def test_topk_gate(ds_world, logits, k, drop_tokens):
    """Adapted from TestTopkGate.test (test_moe.py, SOURCE): its logits (rank 0's: scale 1), here
    through the layer with capacity_factor=1 and min_capacity=1 as there; MoK's output, exp_counts
    and d_x against the stock layer's, which keeps the tokens DeepSpeed's gate keeps."""
    logits = torch.tensor(logits)
    stock, mok = _logits_pair(logits, k, capacity_factor=1, min_capacity=1, drop_tokens=drop_tokens)
    _compare_layers(stock, mok, logits, "TestTopkGate")


def test_topkgating_probs_capacity_exceeds_num_tokens(ds_world):
    """Adapted from test_topkgating_probs_capacity_exceeds_num_tokens (test_moe.py, SOURCE):
    s=8, e=2, k=2, capacity_factor=2 -> capacity 16 > 8 tokens: nothing is dropped. Through the layer
    (DeepSpeed's k = 2 gate is top2gating), against the stock layer."""
    num_tokens, num_experts, k = 8, 2, 2
    logits = torch.randn(num_tokens, num_experts)
    stock, mok = _logits_pair(logits, k, capacity_factor=2.0, eval_capacity_factor=2.0, min_capacity=0)
    _compare_layers(stock, mok, logits, "capacity 16")


def test_top1gating_drop_capacity_exceeds_num_tokens(ds_world):
    """Adapted from test_top1gating_drop_capacity_exceeds_num_tokens (test_moe.py, SOURCE):
    s=8, e=2, capacity_factor=4 -> capacity = ceil(8/2 * 4) = 16 > 8: every token is kept."""
    num_tokens, num_experts = 8, 2
    logits = torch.randn(num_tokens, num_experts)
    stock, mok = _logits_pair(logits, 1, capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=0)
    _compare_layers(stock, mok, logits, "capacity 16")


def test_topkgating_position_preserves_min_capacity(ds_world):
    """Adapted from test_topkgating_position_preserves_min_capacity (test_moe.py, SOURCE): min_capacity
    pads the capacity. There: 4 tokens, 2 experts, k = 1 through topkgating (capacity 2, min_capacity 8).
    Through the layer k = 1 is top1gating, which asserts tokens >= min_capacity, so here: 8 tokens,
    capacity_factor 0.5 (capacity 2), min_capacity 6 (capacity 6), and the logits send 6 tokens to
    expert 0: nothing is dropped, where a layer that ignored min_capacity would drop 4. Against the
    stock layer."""
    logits = torch.tensor([[2.0, 0.0], [1.5, 0.2], [0.9, 0.1], [0.0, 1.0], [1.2, -0.3], [0.4, 0.1], [0.3, 0.9],
                           [0.8, 0.0]])  # fmt: skip
    stock, mok = _logits_pair(logits, 1, capacity_factor=0.5, eval_capacity_factor=0.5, min_capacity=6)
    _compare_layers(stock, mok, logits, "min_capacity 6")


# --- TestExpertWeightGradWithZero ---------------------------------------------------------------------


def _expert_grad_body(zero_stage: int) -> None:
    """Copied from TestExpertWeightGradWithZero.test (test_moe.py, SOURCE); MoK through apply().
    CPU: "torch_adam": true (module docstring)."""

    def seed_everything(seed=11):
        random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed(seed)
        get_accelerator().manual_seed_all(seed)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    def get_state_dict_ep2(state_dict):
        """
        convert state_dict from EP=1 to EP=2
        """
        rank = int(deepspeed.comm.get_rank())
        ep_state_dict = dict()
        dst_sub_key = "deepspeed_moe.experts.deepspeed_experts.0"
        src_sub_key = f"deepspeed_moe.experts.deepspeed_experts.{rank}"
        for moe_layer in ["moe_1", "moe_2"]:
            for mlp_in_moe in [0, 1]:
                dst_key = f"{moe_layer}.{dst_sub_key}.{mlp_in_moe}"
                src_key = f"{moe_layer}.{src_sub_key}.{mlp_in_moe}"
                ep_state_dict[f"{dst_key}.weight"] = state_dict[f"{src_key}.weight"].detach().clone()
                ep_state_dict[f"{dst_key}.bias"] = state_dict[f"{src_key}.bias"].detach().clone()

        for key in state_dict.keys():
            if "deepspeed_moe.experts.deepspeed_experts" not in key:
                ep_state_dict[key] = state_dict[key].detach().clone()
        return ep_state_dict

    def get_models(hidden_dim):
        model_ep1 = SimpleMoEModel(hidden_dim=hidden_dim, num_experts=2, ep_size=1, use_rts=False)
        model_ep2 = SimpleMoEModel(hidden_dim=hidden_dim, num_experts=2, ep_size=2, use_rts=False)
        _assert_is_mok(model_ep1)
        _assert_is_mok(model_ep2)

        state_dict_ep1 = model_ep1.state_dict()
        state_dict_ep2 = get_state_dict_ep2(state_dict_ep1)
        model_ep2.load_state_dict(state_dict_ep2)

        model_ep1, _, _, _ = deepspeed.initialize(config=config_dict, model=model_ep1)
        model_ep2, _, _, _ = deepspeed.initialize(config=config_dict, model=model_ep2)

        return model_ep1, model_ep2

    def extract_expert_grad(model, expert_id):

        def _get_weight_bias(experts):
            return ([deepspeed.utils.safe_get_full_grad(expert[0].weight)
                     for expert in experts][expert_id].detach().clone(),
                    [deepspeed.utils.safe_get_full_grad(expert[0].bias)
                     for expert in experts][expert_id].detach().clone(),
                    [deepspeed.utils.safe_get_full_grad(expert[1].weight)
                     for expert in experts][expert_id].detach().clone(),
                    [deepspeed.utils.safe_get_full_grad(expert[1].bias)
                     for expert in experts][expert_id].detach().clone())  # fmt: skip

        return (*_get_weight_bias(model.moe_1.deepspeed_moe.experts.deepspeed_experts),
                *_get_weight_bias(model.moe_2.deepspeed_moe.experts.deepspeed_experts))  # fmt: skip

    seed_everything()

    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.1,
            }
        },
        "zero_optimization": {
            "stage": zero_stage
        }
    }  # fmt: skip
    config_dict = _cpu_config(config_dict)

    with _mok(config_dict):
        hidden_dim = 4
        total_samples = 2
        rank = deepspeed.comm.get_rank()
        model_ep1, model_ep2 = get_models(hidden_dim)

    data_loader = sequence_dataloader(model=model_ep1,
                                      total_samples=total_samples,
                                      hidden_dim=hidden_dim,
                                      device=model_ep1.device,
                                      dtype=torch.float32)  # fmt: skip
    expert_weight_grad_ep1 = []
    expert_weight_grad_ep2 = []
    for batch in data_loader:
        loss_ep1 = model_ep1(batch[0], batch[1])
        loss_ep2 = model_ep2(batch[0], batch[1])

        model_ep1.backward(loss_ep1)
        model_ep2.backward(loss_ep2)

        expert_weight_grad_ep1.extend(extract_expert_grad(model_ep1, rank))
        expert_weight_grad_ep2.extend(extract_expert_grad(model_ep2, 0))

        model_ep1.step()
        model_ep2.step()

    assert len(expert_weight_grad_ep1) == len(expert_weight_grad_ep2)
    for grad_from_ep1, grad_from_ep2 in zip(expert_weight_grad_ep1, expert_weight_grad_ep2):
        assert torch.allclose(grad_from_ep1, grad_from_ep2, atol=0, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_expert_weight_grad_with_zero(zero_stage):
    """TestExpertWeightGradWithZero: world size 2, fp32; the same model at EP = 1 and EP = 2 (expert
    `rank` of EP = 1 is expert 0 of EP = 2 on that rank); each expert's full gradient (ZeRO's
    safe_get_full_grad) through the structure view `deepspeed_moe.experts.deepspeed_experts[i]`
    must agree (rtol 1e-4)."""
    _run_ranks(2, _expert_grad_body, zero_stage=zero_stage)
