"""Multi-GPU, one host: topology invariance of the expert-parallel layer over real NCCL and
symmetric memory. On one global batch, the MoK layer at EP = 2, 4, ... up to the GPU count gives
outputs, input gradients and expert weight gradients bitwise equal to EP = 1, for each exchange and
transport: capacity over NCCL, exact over NCCL, capacity over symmetric memory; top-8 uniform,
top-2 skewed (every first choice on rank 0's expert), top-1 uniform; bf16, one shared expert,
sigmoid scores.

The ranks are spawned once for the module (one process per visible GPU) and every case is run in
them; each test then checks one (transport, exchange, case). NVLink multicast stays off
(mok_plugin.parallel.keep_multicast_off: NCCL_NVLS_ENABLE=0 and its peers). The same check on the
CPU, with gloo, is tests/test_parallel.py. `mok bench multi-gpu` runs this file as its part 1.
"""

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices"),
]

from mok_plugin import MoKConfig, MoKMoE  # noqa: E402
from mok_plugin.parallel import keep_multicast_off  # noqa: E402
from mok_plugin.testing import make_layer_inputs, run_ranks  # noqa: E402

# Global tokens, hidden, expert intermediate, experts: 64 experts divide among 2, 4 and 8 GPUs.
T, H, I, E = 4096, 1024, 512, 64
# (name, top_k, skewed): skewed sends every first choice to expert 0 (on rank 0), so the other
# ranks send most rows away and many experts get none.
CASES = [("top8_uniform", 8, False), ("top2_skewed", 2, True), ("top1_uniform", 1, False)]
# (transport, exchange)
PATHS = [("nccl", "capacity"), ("nccl", "exact"), ("symmetric_memory", "capacity")]
COMPARED = ("out", "d_x", "d_gate_up_proj", "d_down_proj")


def ep_sizes(world: int, num_experts: int) -> list[int]:
    """1, 2, 4, ... up to world, keeping those that divide the expert count."""
    sizes, ep = [], 1
    while ep <= world:
        if num_experts % ep == 0:
            sizes.append(ep)
        ep *= 2
    return sizes


def _run_case(case, path, ep: int, group, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's share of one EP = ep run of the layer: outputs and gradients, on the CPU."""
    _, top_k, skewed = case
    transport, exchange = path
    rank = dist.get_rank(group)
    config = MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=top_k, num_shared_experts=1,
                       score_function="sigmoid", expert_bias=skewed, params_dtype="bfloat16", ep_size=ep,
                       ep_exchange=exchange, ep_transport=transport, ep_capacity_factor=float(ep))  # fmt: skip
    layer = MoKMoE(config, ep_group=group, device=device, seed=3, init_std=0.05)
    if skewed:
        with torch.no_grad():
            layer.expert_bias[0] = 100.0
    rows = slice(rank * T // ep, (rank + 1) * T // ep)
    x = make_layer_inputs(T, H, dtype=layer.params_dtype, device=device, seed=4)[rows].clone().requires_grad_()
    probe = make_layer_inputs(T, H, device=device, seed=5)[rows]
    out, aux = layer(x)
    ((out.float() * probe).sum() + aux).backward()
    result = {"out": out, "d_x": x.grad, "d_gate_up_proj": layer.experts.gate_up_proj.grad,
              "d_down_proj": layer.experts.down_proj.grad}  # fmt: skip
    return {k: v.detach().cpu() for k, v in result.items()}


def _rank(rank: int, world: int, port: int, out_path: str) -> None:
    """One spawned rank: every path and case at every EP size; rank 0 compares and writes JSON."""
    keep_multicast_off()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    sizes = ep_sizes(world, E)
    groups = {ep: dist.new_group(list(range(ep))) for ep in sizes}  # every rank joins every new_group
    rows = []
    try:
        for path in PATHS:
            for case in CASES:
                expected = None
                for ep in sizes:
                    share = _run_case(case, path, ep, groups[ep], device) if rank < ep else None
                    shares: list | None = [None] * world if rank == 0 else None
                    dist.gather_object(share, shares, dst=0)
                    if rank != 0:
                        continue
                    # rank-major: tokens for out/d_x, experts for the weight gradients
                    got = {k: torch.cat([s[k] for s in shares[:ep]]) for k in COMPARED}
                    if expected is None:
                        expected = got
                    equal = {k: bool(torch.equal(got[k], expected[k])) for k in COMPARED}
                    rows.append({"transport": path[0], "exchange": path[1], "case": case[0], "ep": ep, "equal": equal})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world": world, "sizes": sizes, "rows": rows}, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def invariance(tmp_path_factory) -> dict:
    keep_multicast_off()  # the spawned ranks inherit it
    out = tmp_path_factory.mktemp("multi_gpu") / "invariance.json"
    run_ranks(_rank, torch.cuda.device_count(), args=(str(out),), timeout_s=1200)
    return json.loads(out.read_text())


@pytest.mark.parametrize("path", PATHS, ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_ep_sizes_bitwise_equal_to_ep1(invariance, path, case):
    rows = [r for r in invariance["rows"] if (r["transport"], r["exchange"], r["case"]) == (*path, case[0])]
    assert [r["ep"] for r in rows] == invariance["sizes"] and len(rows) >= 2
    differing = {r["ep"]: [k for k, same in r["equal"].items() if not same] for r in rows}
    assert not any(differing.values()), f"differs from EP = 1: {differing}"
