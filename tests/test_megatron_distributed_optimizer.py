"""--use-distributed-optimizer with MoKMoELayer (CUDA: Megatron's optimizer and its reduce-scatter
need a GPU and NCCL): training steps under Megatron's DistributedDataParallel and DistributedOptimizer,
and their distributed checkpoints (torch_dist, fully parallel save and load, the optimizer state in
model space: --dist-ckpt-optim-fully-reshardable) from the stock layer into MoK and back. After the
load, one more step of each with zero gradients (Adam moves the weights by its moments alone) gives
the same parameters: the optimizer's moments moved with the weights, under the stock keys.

Both with fp32 weights (the optimizer steps them in place) and with bf16 weights and fp32 main
copies, as a bf16 run keeps them. The default optimizer format (dp_reshardable) stores each
data-parallel rank's flat buffers as they lie in memory, which depend on the module's parameter
layout; it reloads into the same layer kind only, stock or MoK, and a test checks MoK's own round
trip, in bf16: with fp32 weights Megatron 0.19 cannot load that format into any layer (it copies
into a view of the weight that requires grad)."""

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.serialization import (  # noqa: E402
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from test_megatron import E, H, _config  # noqa: E402

from mok_plugin.megatron import use_mok  # noqa: E402
from mok_plugin.testing import make_layer_inputs  # noqa: E402

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron's distributed optimizer needs CUDA and NCCL"),
]


@pytest.fixture()
def fused_adam(monkeypatch):
    """Megatron's Adam with its step in the param groups, as TE's and Apex's FusedAdam keep it.

    Without either, Megatron 0.19 falls back to torch's Adam, whose per-parameter `step` its
    distributed optimizer cannot round-trip: the state dict of a fresh optimizer asserts one step
    value, and after a step load_parameter_state_from_fully_reshardable skips `step` on read and
    then copies into it (KeyError: 'step'), for the stock layer alike. There DeepSpeed's FusedAdam
    (built on first use, as DeepSpeed builds it) stands in: the same contract, moments in the state
    and the step in the param groups."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    major, minor = torch.cuda.get_device_capability()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # DeepSpeed's builder cannot parse "9.0a"
    try:
        from deepspeed.ops.adam import FusedAdam

        FusedAdam([torch.zeros(1, device="cuda", requires_grad=True)])  # builds the extension
    except Exception as error:  # noqa: BLE001 - any build failure means: no stand-in here
        pytest.skip(f"neither TE's, Apex's nor DeepSpeed's FusedAdam is available ({error}); torch's Adam "
                    "cannot round-trip Megatron 0.19's distributed-optimizer checkpoints")  # fmt: skip

    class StandIn(FusedAdam):
        """Apex's contract: the step in each param group only (DeepSpeed's also keeps an int per
        parameter, which Megatron's checkpoints neither save nor restore)."""

        def __init__(self, params, capturable: bool = False, **kwargs):  # Megatron passes capturable
            assert not capturable, "DeepSpeed's FusedAdam is not capturable"
            super().__init__(params, **kwargs)

        def step(self, *args, **kwargs):
            for group in self.param_groups:
                for param in group["params"]:
                    if self.state[param]:
                        self.state[param]["step"] = group.get("step", 0)
            result = super().step(*args, **kwargs)
            for group in self.param_groups:
                # DeepSpeed's kernel call uses one step for the group and advances only the
                # last parameter's count (per dtype): the group's step is the largest.
                steps = [self.state[param].pop("step") for param in group["params"] if self.state[param]]
                group["step"] = max(steps, default=group.get("step", 0))
            return result

    monkeypatch.setattr(megatron_optimizer, "Adam", StandIn)
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib_optimizer, "Adam", StandIn)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def _trainer(build, cfg):
    """(DDP-wrapped layer, its DistributedOptimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    layer = build(config=cfg).cuda()
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), layer
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=LR, use_distributed_optimizer=True, params_dtype=cfg.params_dtype, bf16=cfg.bf16
        ),
        [ddp],
    )
    return ddp, optimizer


def _step(ddp, optimizer, step: int) -> None:
    dtype = ddp.module.config.params_dtype
    x = make_layer_inputs(24, H, seed=step).view(12, 2, H).cuda().to(dtype)
    probe = make_layer_inputs(24, H, seed=100 + step).view(12, 2, H).cuda().to(dtype)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    out, _ = ddp(x)
    (out * probe).sum().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0], "the optimizer skipped its step"


def _save(ddp, optimizer, path: str, sharding: str) -> None:
    model = ddp.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding}
    state = {"model": model, "optimizer": optimizer.sharded_state_dict(model, metadata=metadata)}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path, FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy()))


def _load(ddp, optimizer, path: str, sharding: str) -> None:
    model = ddp.module.sharded_state_dict()
    template = {"model": model, "optimizer": optimizer.sharded_state_dict(
        model, is_loading=True, metadata={"distrib_optim_sharding_type": sharding})}  # fmt: skip
    loaded = dist_checkpointing.load(
        template, path, FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path))
    )
    ddp.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])


def _weights(ddp) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items() if isinstance(v, torch.Tensor)}


LR = 1e-2


def _assert_weights_close(got: dict, want: dict, what: str) -> None:
    """fp32: within fp32's tolerance. bf16: within a few bf16 ulps (a weight re-derived from its
    bf16 copy and one kept in fp32 may round a step differently) on all but 1 % of the elements,
    and none by half of LR: a lost moment or step moves most elements by a sizeable part of LR."""
    assert set(got) == set(want), what
    for key in want:
        a, b = got[key], want[key]
        if b.dtype != torch.bfloat16:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{what}, {k}: {m}")
            continue
        diff = (a.float() - b.float()).abs()
        beyond_ulp = (diff > 5e-4 + 1.6e-2 * b.float().abs()).float().mean().item()
        assert beyond_ulp <= 0.01 and diff.max().item() < LR / 2, (
            f"{what}, {key}: {beyond_ulp:.1%} beyond a bf16 ulp, max {diff.max().item():.3g}"
        )


FIELDS = {"swiglu_shared": dict(moe_shared_expert_intermediate_size=24), "no_shared": {}}
DTYPES = {"fp32": {}, "bf16": dict(bf16=True, params_dtype=torch.bfloat16)}


def _resumed(build, cfg, trainer, path: str, sharding: str):
    """A fresh (layer, optimizer) from `build` that loads what `trainer` saves to `path`."""
    _save(*trainer, path, sharding)
    fresh = _trainer(build, cfg)
    _load(*fresh, path, sharding)
    return fresh


def _step_on_the_moments(ddp, optimizer) -> None:
    """An optimizer step with every gradient zero: Adam then moves each weight by its moments and
    step count alone, so two trainers agree only if those came across, and a lost moment leaves its
    weight where it was. (A step on data compared the two layers' gradients too, whose bf16
    rounding Adam amplifies where a gradient is near zero: on the H200 1 run in 3 put 9 % of the
    router's weights beyond the bound, up to 0.6 LR off.)"""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    assert optimizer.step()[0], "the optimizer skipped its step"


def _assert_same_step(a, b, what: str) -> None:
    """One more step of each trainer, on its moments alone, gives the same weights; and that step
    moved them (the moments are not zero, so the comparison can fail)."""
    before = _weights(b[0])
    _step_on_the_moments(*a)
    _step_on_the_moments(*b)
    after = _weights(b[0])
    moved = [key for key in after if not torch.equal(after[key], before[key])]
    assert moved, f"{what}: the step moved no weight"
    _assert_weights_close(_weights(a[0]), after, what)


@pytest.mark.usefixtures("nccl_world", "fused_adam")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("fields", list(FIELDS.values()), ids=list(FIELDS))
def test_stock_to_mok_to_stock_with_the_optimizer_state(tmp_path, fields, dtype):
    cfg = _config(**fields, **dtype, use_cpu_initialization=False)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    stock = _trainer(spec, cfg)
    for step in range(2):
        _step(*stock, step)
    mok = _resumed(use_mok(spec), cfg, stock, str(tmp_path / "stock"), "fully_reshardable")
    _assert_weights_close(_weights(mok[0]), _weights(stock[0]), "MoK after loading stock's checkpoint")
    # One more step each: the same update only if Adam's moments came across with the weights.
    _assert_same_step(mok, stock, "after a step from stock's optimizer state")
    # ... and back: a fresh stock layer from MoK's checkpoint steps as MoK does.
    fresh = _resumed(spec, cfg, mok, str(tmp_path / "mok"), "fully_reshardable")
    _assert_same_step(fresh, mok, "stock after a step from MoK's optimizer state")


@pytest.mark.usefixtures("nccl_world", "fused_adam")
def test_mok_round_trip_in_the_default_optimizer_format(tmp_path):
    cfg = _config(moe_shared_expert_intermediate_size=24, **DTYPES["bf16"], use_cpu_initialization=False)
    build = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))
    mok = _trainer(build, cfg)
    _step(*mok, 0)
    again = _resumed(build, cfg, mok, str(tmp_path / "mok"), "dp_reshardable")
    _assert_same_step(again, mok, "MoK after its own dp_reshardable round trip")
