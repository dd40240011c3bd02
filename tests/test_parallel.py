"""Expert parallelism on the CPU with gloo: 1, 2 and 4 processes share one global batch and must
reproduce the single-process layer bitwise: outputs, input gradients and expert weight gradients,
for top-1, top-2 and top-8 routing, uniform and skewed (every first choice on rank 0's expert, so
other ranks send everything away and most experts get no token); with token dropping; bf16 too;
through both exchanges:
exact (batch split unevenly, one rank with no tokens) and capacity (fixed-size buffers, equal
split). Also: the router still gets a gradient, a capacity overflow and bad groups raise, and the
forward's stages show as the profiler ranges mok_plugin.ep.dispatch, .experts and .combine."""

import os

import pytest
import torch
import torch.distributed as dist

from mok_plugin import MoKConfig, MoKMoE
from mok_plugin.testing import EXPERT_FAMILIES, assert_close, init_gloo, make_layer_inputs, run_ranks

pytestmark = pytest.mark.distributed

H, I, E = 16, 12, 8
# (name, top_k, skewed, dtype, exchange, backend)
CASES = [
    ("top1_uniform", 1, False, "float32", "exact", "reference"),
    ("top1_skewed", 1, True, "float32", "exact", "reference"),
    ("top2_uniform", 2, False, "float32", "exact", "reference"),
    ("top2_skewed", 2, True, "float32", "exact", "reference"),
    ("top8_uniform", 8, False, "float32", "exact", "reference"),
    ("top8_skewed", 8, True, "float32", "exact", "reference"),
    ("top2_bf16", 2, False, "bfloat16", "exact", "reference"),
    ("capacity_top2_uniform", 2, False, "float32", "capacity", "reference"),
    ("capacity_top1_skewed", 1, True, "float32", "capacity", "reference"),
    ("capacity_top8_bf16", 8, False, "bfloat16", "capacity", "reference"),
    # The Triton kernels (in the interpreter on the CPU) on the received rows.
    ("triton_top2_skewed", 2, True, "float32", "capacity", "triton"),
    # Token dropping (mok.capacity_factor): skewed routing overfills expert 0; every EP size keeps
    # the rows the single process keeps (each expert's first rows in global token order).
    ("drop_top2_skewed_exact", 2, True, "float32", "exact", "reference", dict(capacity_factor=0.5)),
    ("drop_top1_skewed_capacity", 1, True, "float32", "capacity", "reference", dict(capacity_factor=1.0)),
    # Expert families with random biases (routed and shared): the bias gradients too are bitwise
    # the same at every EP size.
    ("gpt_oss_top2_skewed", 2, True, "float32", "exact", "reference", EXPERT_FAMILIES["gpt_oss"].config_fields()),
    ("triton_mlp_bias_top2", 2, False, "float32", "capacity", "triton",
     EXPERT_FAMILIES["mlp_gelu_bias"].config_fields()),
]  # fmt: skip
# Tokens per rank for each world size. Exact: uneven, and rank 1 of 4 has none. Capacity: equal.
SPLITS = {
    "exact": {1: [30], 2: [13, 17], 4: [5, 0, 15, 10]},
    "capacity": {1: [32], 2: [16, 16], 4: [8, 8, 8, 8]},
}


def _config(
    top_k: int, skewed: bool, dtype: str, ep_size: int, exchange: str = "exact", backend: str = "reference"
) -> MoKConfig:
    # With a shared expert: it runs on each rank's own tokens, batch-invariantly with both backends.
    # A capacity factor of ep_size lets one rank send all its pairs to one rank, so these cases
    # never overflow.
    return MoKConfig(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=top_k,
                     num_shared_experts=1, score_function="sigmoid",
                     expert_bias=skewed, params_dtype=dtype, ep_size=ep_size, ep_exchange=exchange,
                     ep_capacity_factor=float(ep_size), backend=backend)  # fmt: skip


def _run_case(case, ep_size: int, rank: int, group) -> dict[str, torch.Tensor]:
    name, top_k, skewed, dtype, exchange, backend, *extra = case
    config = _config(top_k, skewed, dtype, ep_size, exchange, backend)
    if extra:
        config = config.replace(**extra[0])
    layer = MoKMoE(config, ep_group=group, seed=3, init_std=0.2)
    _random_biases(layer, rank)
    if skewed:
        layer.expert_bias[0] = 100.0  # expert 0 (on rank 0) is everyone's first choice
    torch_dtype = layer.params_dtype
    splits = SPLITS[exchange][ep_size]
    start, stop = sum(splits[:rank]), sum(splits[: rank + 1])
    x = make_layer_inputs(sum(splits), H, dtype=torch_dtype, seed=4)[start:stop].clone().requires_grad_()
    probe = make_layer_inputs(sum(splits), H, seed=5)[start:stop]
    out, aux = layer(x)
    ((out.float() * probe).sum() + aux).backward()
    return {
        "out": out.detach(),
        "d_x": x.grad,
        "d_gate_up_proj": layer.experts.gate_up_proj.grad,
        "d_down_proj": layer.experts.down_proj.grad,
        "d_router": layer.router.weight.grad,
        "dropped": layer.last_num_dropped.clone(),
        **{f"d_{n}": p.grad for n, p in layer.named_parameters() if n.startswith("experts.") and n.endswith("_bias")},
    }


def _random_biases(layer: MoKMoE, rank: int) -> None:
    """Seeded random biases (they start at zero), the same values at every EP size: each rank takes
    its experts' rows of the full [E, ...] draw."""
    generator = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for name, param in sorted(layer.named_parameters()):
            if name.endswith("_bias"):
                routed = name.startswith("experts.")
                full = torch.randn((E, *param.shape[1:]) if routed else param.shape, generator=generator)
                param.copy_(full[rank * param.shape[0] : (rank + 1) * param.shape[0]] if routed else full)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        results = {case[0]: _run_case(case, world, rank, dist.group.WORLD) for case in CASES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_world(world: int, tmp_path) -> list[dict]:
    run_ranks(_worker, world, (str(tmp_path),))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def single_process():
    return {case[0]: _run_case(case, 1, 0, None) for case in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_topology_invariance_bitwise(world, tmp_path, single_process):
    ranks = _run_world(world, tmp_path)
    for name, *_ in CASES:
        want = single_process[name]
        got_out = torch.cat([r[name]["out"] for r in ranks])
        got_dx = torch.cat([r[name]["d_x"] for r in ranks])
        got_w13 = torch.cat([r[name]["d_gate_up_proj"] for r in ranks])
        got_w2 = torch.cat([r[name]["d_down_proj"] for r in ranks])
        assert torch.equal(got_out, want["out"]), f"{name}: output differs at world size {world}"
        assert torch.equal(got_dx, want["d_x"]), f"{name}: input gradient differs at world size {world}"
        assert torch.equal(got_w13, want["d_gate_up_proj"]), f"{name}: dW13 differs at world size {world}"
        assert torch.equal(got_w2, want["d_down_proj"]), f"{name}: dW2 differs at world size {world}"
        for bias in [key for key in want if key.endswith("_bias")]:
            got_bias = torch.cat([r[name][bias] for r in ranks])
            assert torch.equal(got_bias, want[bias]), f"{name}: {bias} differs at world size {world}"
        dropped = sum(int(r[name]["dropped"]) for r in ranks)  # each rank counts its experts' drops
        assert dropped == int(want["dropped"]), f"{name}: {dropped} pairs dropped, single process {want['dropped']}"
        assert (dropped > 0) == name.startswith("drop_"), f"{name}: dropped {dropped}"
        # The router is replicated: each rank's gradient covers its own tokens, and they add up
        # (in another order, so closely, not bitwise) to the single-process gradient.
        router = sum(r[name]["d_router"].double() for r in ranks)
        assert router.abs().sum() > 0, f"{name}: the router got no gradient"
        assert_close(router, want["d_router"], want["d_router"].dtype, f"{name}: d_router", n_reduce=64 * world)


def _overflow_worker(rank: int, world: int, port: int) -> None:
    init_gloo(rank, world, port)
    try:
        cfg = _config(1, True, "float32", world, "capacity").replace(ep_capacity_factor=0.5)
        layer = MoKMoE(cfg, ep_group=dist.group.WORLD, seed=3)
        layer.expert_bias[0] = 100.0  # every pair goes to rank 0: four times the buffer of 0.5
        layer(make_layer_inputs(8, H, seed=rank))
    finally:
        dist.destroy_process_group()


def test_capacity_overflow_names_the_factor():
    with pytest.raises(Exception, match=r"raise mok\.ep_capacity_factor"):
        run_ranks(_overflow_worker, 2, timeout_s=120)


def test_bad_groups_raise():
    with pytest.raises(ValueError, match=r"mok\.ep_size=2 needs ep_group"):
        MoKMoE(_config(2, False, "float32", 2))


def _profiled_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        names = {}
        for exchange in ("exact", "capacity"):
            layer = MoKMoE(_config(2, False, "float32", world, exchange), ep_group=dist.group.WORLD, seed=3)
            x = make_layer_inputs(8, H, seed=rank).requires_grad_()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out, aux = layer(x)
                (out.sum() + aux).backward()
            events = sorted(prof.events(), key=lambda event: event.time_range.start)
            names[exchange] = [event.name for event in events if event.name.startswith("mok_plugin.")]
        torch.save(names, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_stages_are_profiler_ranges(tmp_path):
    # The layer has no benchmark hook: profilers (and scripts/bench_ep.py) find the expert-parallel
    # stages by these range names, once per forward, in this order, on every rank, for both exchanges.
    from mok_plugin.parallel import PROFILER_RANGES

    assert PROFILER_RANGES == ("mok_plugin.ep.dispatch", "mok_plugin.ep.experts", "mok_plugin.ep.combine")
    assert not hasattr(MoKMoE(_config(2, False, "float32", 1)), "ep_stage_timer")
    run_ranks(_profiled_worker, 2, (str(tmp_path),), timeout_s=120)
    for rank in range(2):
        names = torch.load(tmp_path / f"rank{rank}.pt")
        for exchange in ("exact", "capacity"):
            assert names[exchange] == list(PROFILER_RANGES), f"rank {rank}, {exchange}: {names[exchange]}"


@pytest.mark.slow
def test_bench_ep_runs_and_writes_json(tmp_path):
    # The EP benchmark end to end on 2 gloo processes at a tiny shape: it prints and writes its JSON.
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_ep.py"
    args = ["--nprocs", "2", "--shape", "16,32,16,4,2", "--tokens-per-rank", "8", "--iters", "2", "--warmup", "1"]
    run = subprocess.run([sys.executable, str(script), *args, "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "dispatch GB/s" in run.stdout
    result = json.loads((tmp_path / "bench_ep.json").read_text())
    assert set(result["per_rank"]) == {"0", "1"}
    for row in result["per_rank"].values():
        assert row["bytes"] > 0 and all(row[s] > 0 for s in ("dispatch", "experts", "combine", "backward"))


def test_symmetric_memory_transport_errors():
    from mok_plugin import MoKConfigError
    from mok_plugin.parallel.symmetric import symmetric_all_to_all_equal

    with pytest.raises(MoKConfigError, match=r"ep_transport='symmetric_memory' needs mok\.ep_exchange='capacity'"):
        _config(2, False, "float32", 2, "exact").replace(ep_transport="symmetric_memory")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        symmetric_all_to_all_equal(torch.zeros(4, 2), group=None)
