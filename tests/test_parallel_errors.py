"""An error on one expert-parallel rank is the same clear error on every rank, decided before any
rank enters an exchange it could not finish (gloo, 2 and 4 processes, each run with a timeout so a
hang fails the test):
- a capacity-exchange overflow caused by one rank's routing alone;
- uneven token counts under the capacity exchange;
- non-finite router logits on one rank, with the debug checks on.
Every rank catches its error and goes on to a normal step, which must then complete on every rank:
no rank was left inside an exchange."""

import json
import os
import re

import pytest
import torch
import torch.distributed as dist

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.testing import init_gloo, make_layer_inputs, run_ranks

pytestmark = pytest.mark.distributed

H, I, E = 16, 12, 8
TOKENS = 8
FAULTY_RANK = 1


def _layer(world: int, group, **changes) -> MoKMoE:
    config = MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=2, num_shared_experts=1,
                       score_function="sigmoid", expert_bias=True, ep_size=world, **changes)  # fmt: skip
    return MoKMoE(config, ep_group=group, seed=3, init_std=0.2)


def _step(layer: MoKMoE, x: torch.Tensor) -> None:
    out, aux = layer(x.clone().requires_grad_())
    (out.square().sum() + aux).backward()


def _overflow(rank: int, world: int, group) -> None:
    # Only the faulty rank sends all its pairs to rank 0: 16 rows into a block of
    # ceil(0.5 * 8 * 2 / world) rows. The others' routing fits.
    layer = _layer(world, group, ep_exchange="capacity", ep_capacity_factor=0.5)
    if rank == FAULTY_RANK:
        layer.expert_bias[: E // world] = 100.0
    _step(layer, make_layer_inputs(TOKENS, H, seed=rank))


def _uneven_tokens(rank: int, world: int, group) -> None:
    layer = _layer(world, group, ep_exchange="capacity", ep_capacity_factor=float(world))
    _step(layer, make_layer_inputs(TOKENS - 2 if rank == FAULTY_RANK else TOKENS, H, seed=rank))


def _non_finite_logits(rank: int, world: int, group) -> None:
    layer = _layer(world, group, ep_exchange="exact", debug_checks=True)
    x = make_layer_inputs(TOKENS, H, seed=rank)
    if rank == FAULTY_RANK:
        x[3, 0] = float("inf")
    _step(layer, x)


FAULTS = {"overflow": _overflow, "uneven_tokens": _uneven_tokens, "non_finite_logits": _non_finite_logits}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port, timeout_s=60)
    report = {}
    try:
        for name, fault in FAULTS.items():
            try:
                fault(rank, world, dist.group.WORLD)
                report[name] = None
            except Exception as error:  # noqa: BLE001 - the test compares what every rank raised
                report[name] = f"{type(error).__name__}: {error}".split("\n")[0]
            # Every rank goes on to a normal step: it completes only if no rank was left in an exchange.
            _step(_layer(world, dist.group.WORLD, ep_exchange="capacity", ep_capacity_factor=float(world)),
                  make_layer_inputs(TOKENS, H, seed=10 + rank))  # fmt: skip
            report[f"{name} then a normal step"] = "done"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_error_is_every_rank_error(world, tmp_path):
    run_ranks(_worker, world, (str(tmp_path),), timeout_s=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    expected = {
        "overflow": r"expert-parallel buffer overflow.*raise mok\.ep_capacity_factor",
        "uneven_tokens": r"needs the same number of tokens on every expert-parallel rank",
        "non_finite_logits": rf"non-finite router logits on expert-parallel rank\(s\) \[{FAULTY_RANK}\]",
    }
    for name, pattern in expected.items():
        messages = [report[name] for report in reports]
        assert all(m is not None and re.search(pattern, m) for m in messages), f"{name}: ranks raised {messages}"
        if name != "non_finite_logits":  # that message also lists each rank's own bad tokens
            assert len(set(messages)) == 1, f"{name}: ranks raised different errors: {messages}"
        assert all(report[f"{name} then a normal step"] == "done" for report in reports), name
