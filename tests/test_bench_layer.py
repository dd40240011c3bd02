"""The layer benchmark's parts that run without a GPU: the FLOP convention, the summary statistics
(median, p20-p80, slowest rank per iteration), the check every provider passes before it is timed
(a wrong one is reported and never timed; a missing peer is a ProviderUnavailable), Megatron-Core's
stock peer against the reference on the CPU, and the memory trace behind `--memory` on a synthetic
allocator trace."""

import contextlib
import sys

import pytest
import torch

from mok_plugin.bench import layer, providers
from mok_plugin.bench.floor import floor_bytes, routed_experts
from mok_plugin.bench.flops import moe_flops
from mok_plugin.bench.layer import add_rounds, bench_provider
from mok_plugin.bench.memory import peak_live_set
from mok_plugin.bench.timing import slowest_rank_median, summarize
from mok_plugin.experts import MoKExpertFamily
from mok_plugin.testing import NAMED_SHAPES, MoEShape

SHAPE = MoEShape(32, 64, 32, 4, 2)


def test_flops_follow_design_md():
    # BENCHMARKS.md's convention: 6/12/18 T*K*H*I for a GLU expert, 4/8/12 for a plain MLP.
    shape = NAMED_SHAPES["qwen3-30b-a3b"]
    tkhi = 16384 * 8 * 2048 * 768
    assert [moe_flops(shape, p) for p in ("forward", "backward", "fwd+bwd")] == [6 * tkhi, 12 * tkhi, 18 * tkhi]
    mlp = MoKExpertFamily("mlp", "gelu")
    assert [moe_flops(shape, p, mlp) for p in ("forward", "backward", "fwd+bwd")] == [
        4 * tkhi, 8 * tkhi, 12 * tkhi,
    ]  # fmt: skip
    with pytest.raises(KeyError):
        moe_flops(shape, "fwd")


def test_summarize_gives_median_and_p20_p80():
    times = [float(t) for t in range(1, 11)]  # 1..10 ms
    summary = summarize(times)
    assert summary["ms"] == 5.5
    assert summary["p20"] < summary["ms"] < summary["p80"]
    assert (summary["p20"], summary["p80"]) == pytest.approx((2.2, 8.8))


def test_rounds_time_the_providers_in_turn_and_pool_their_samples(monkeypatch):
    # --rounds: A B A B ..., every pass's samples pooled, the summary taken over all of them.
    order = []

    def fake_time_passes(fn, inputs, iters, settle_s):
        order.append(fn)
        return {p: [fn(len(order))] * iters for p in ("forward", "backward", "fwd+bwd")}

    monkeypatch.setattr(layer, "time_passes", fake_time_passes)
    rows = [{"samples": {p: [1.0, 1.0] for p in ("forward", "backward", "fwd+bwd")}} for _ in range(2)]

    def a(call):
        return 10.0 * call

    def b(call):
        return -1.0 * call

    add_rounds([(rows[0], a), (rows[1], b)], {}, rounds=3, iters=2, settle_s=0.0)
    assert order == [a, b, a, b]
    assert "clock" not in rows[0]  # no clock log, no clock
    assert rows[0]["samples"]["backward"] == [1.0, 1.0, 10.0, 10.0, 30.0, 30.0]
    assert rows[1]["rounds"] == 3 and rows[1]["fwd+bwd"] == summarize([1.0, 1.0, -2.0, -2.0, -4.0, -4.0])


def test_slowest_rank_then_median():
    # Per iteration the slower rank counts, then the median over iterations; a stage a rank did not run is 0.
    rank0 = [{"forward": 1.0, "dispatch": 0.5}, {"forward": 5.0, "dispatch": 0.5}, {"forward": 2.0, "dispatch": 0.5}]
    rank1 = [{"forward": 3.0}, {"forward": 1.0}, {"forward": 4.0}]
    assert slowest_rank_median([rank0, rank1], ("forward", "dispatch", "combine")) == {
        "forward": 4.0, "dispatch": 0.5, "combine": 0.0,
    }  # fmt: skip


@pytest.fixture(scope="module")
def cpu_case():
    inputs = providers.make_inputs(SHAPE, "skewed", 0, device="cpu")
    expected = providers.fwd_bwd(providers.provider_reference(inputs, SHAPE), inputs)
    return inputs, expected


def test_right_provider_passes_the_check(cpu_case):
    inputs, expected = cpu_case
    result = providers.check_provider(providers.provider_torch(inputs, SHAPE), inputs, SHAPE, expected)
    assert result == {"error": None, "bitwise": True}


def test_wrong_provider_is_reported_and_not_timed(cpu_case, monkeypatch):
    # A provider off by a little in its output: the check names the tensor, and bench_provider
    # returns before anything is timed (no CUDA call at all, so this runs on the CPU).
    inputs, expected = cpu_case
    run = providers.provider_torch(inputs, SHAPE)

    def wrong(*tensors):
        return run(*tensors) * 1.25

    def no_timing(*args, **kwargs):
        raise AssertionError("a wrong provider was timed")

    monkeypatch.setattr("mok_plugin.bench.layer.time_ms", no_timing)
    row = bench_provider("wrong", wrong, inputs, SHAPE, expected, iters=3)
    assert row["error"].startswith("output: max abs err") and row["bitwise"] is True
    assert not {"forward", "backward", "fwd+bwd", "peak_mib"} & set(row)


def test_nondeterministic_provider_is_not_bitwise(cpu_case):
    inputs, expected = cpu_case
    run, calls = providers.provider_torch(inputs, SHAPE), []

    def flaky(*tensors):  # right the first time (the checked pass), off by a bf16 step the second
        calls.append(None)
        return run(*tensors) * (1.0 if len(calls) == 1 else 1 + 2**-7)

    assert providers.check_provider(flaky, inputs, SHAPE, expected) == {"error": None, "bitwise": False}


def test_missing_peer_is_unavailable(monkeypatch, cpu_case):
    inputs, _ = cpu_case
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_moe", None)
    with pytest.raises(providers.ProviderUnavailable, match="liger-kernel is not importable"):
        providers.provider_liger(inputs, SHAPE)
    assert issubclass(providers.ProviderUnavailable, RuntimeError)  # the layer benchmark skips it with the reason


def test_megatron_peer_matches_reference_on_cpu(cpu_case):
    # The Megatron-Core peer: the stock MoELayer (allgather dispatcher on the CPU; the benchmark
    # uses alltoall on GPUs) with the benchmark's routing and weights, against the reference.
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")
    import torch.distributed as dist
    from megatron.core import parallel_state

    inputs = providers.make_inputs(SHAPE, "uniform", 0, device="cpu")
    try:
        layer = providers.build_megatron_moe(SHAPE, "allgather", torch.device("cpu"))
        got = providers.fwd_bwd(providers.megatron_run(layer, inputs, SHAPE), inputs)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    want = providers.fwd_bwd(providers.provider_reference(inputs, SHAPE), inputs)
    assert providers.check(got, want, SHAPE) is None


def test_peak_live_set_finds_the_peak_and_who_allocated_it():
    # --memory: a synthetic allocator trace whose peak is the second of three moments.
    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    torch_frame = frame("/site-packages/torch/nn/functional.py", 10, "linear")
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 20},
        {"action": "alloc", "addr": 1, "size": 300, "frames": [torch_frame, frame("/x/mok_plugin/ops.py", 5, "fwd")]},
        {"action": "alloc", "addr": 2, "size": 500, "frames": [torch_frame]},
        {"action": "free_requested", "addr": 99, "size": 1000},  # allocated before the trace: ignored
        {"action": "alloc", "addr": 3, "size": 200, "frames": []},
        {"action": "free_requested", "addr": 2, "size": 500},
        {"action": "free_completed", "addr": 2, "size": 500},
        {"action": "alloc", "addr": 4, "size": 400, "frames": [frame("/x/mok_plugin/bench/layer.py", 7, "run")]},
    ]
    peak, live = peak_live_set(trace)
    assert peak == 1000  # 300 + 500 + 200, before the free; the later 300 + 200 + 400 is less
    assert live == [
        {"bytes": 300, "site": "ops.py:5 fwd"},  # the project's frame, not torch's
        {"bytes": 500, "site": "functional.py:10 linear"},
        {"bytes": 200, "site": "?"},
    ]
    assert peak_live_set([]) == (0, [])


def test_profile_lists_kernels_and_the_host_time(capsys):
    # --profile: where the GPU time goes and, where measured, how long the host took to issue it.
    from mok_plugin.bench.breakdown import print_breakdown

    row = {"shape": "tiny", "routing": "uniform", "provider": "mok-multi", "fwd+bwd": {"ms": 2.4},
           "kernels": [{"kernel": "_expert_wgrad_kernel", "ms": 0.47, "launches": 2},
                       {"kernel": "_gate_up_fwd_kernel", "ms": 0.03, "launches": 1}]}  # fmt: skip
    print_breakdown(row)
    assert "sum 0.50 ms; timed fwd+bwd 2.40 ms)" in capsys.readouterr().out
    print_breakdown({**row, "host_ms": 2.26})
    out = capsys.readouterr().out
    assert "timed fwd+bwd 2.40 ms; host 2.26 ms)" in out and "94.0% x2   _expert_wgrad_kernel" in out


def _host_work_leaf(n: int) -> int:
    # A loop in the leaf's own frame, so that its time is the leaf's own: sum() of a generator put it
    # on builtins.sum or on the generator, as the profile's timing fell.
    total = 0
    for i in range(n):
        total += i * i
    return total


def test_host_profile_ranks_the_functions_by_their_own_time_per_call(capsys):
    # --host-profile: cProfile over the calls; per call of the work, each function's calls and own
    # time, the heavy leaf first; printed under the row with the unprofiled host time.
    from mok_plugin.bench.breakdown import host_profile, print_host_profile

    def work():
        _host_work_leaf(20000)
        _host_work_leaf(10)
        _host_work_leaf(10)

    rows = host_profile(work, iters=4, top=50)
    leaf = next(r for r in rows if r["function"].endswith("(_host_work_leaf)"))
    assert leaf["calls"] == 3 and "tests/test_bench_layer.py:" in leaf["function"]
    assert leaf is rows[0]
    assert leaf["cum_us"] >= leaf["own_us"] > 0
    assert len(host_profile(work, iters=1, top=2)) == 2
    print_host_profile({"shape": "tiny", "routing": "uniform", "provider": "mok-multi", "host_ms": 1.25,
                        "host_profile": rows[:1]})  # fmt: skip
    out = capsys.readouterr().out
    assert "mok-multi: host time per forward + backward by function" in out and "host 1.25 ms unprofiled" in out


def test_idle_gaps_sum_the_time_no_kernel_covers_by_the_kernels_around_it(capsys):
    # Two calls of three kernels (us): a 100 us wait before "b" each call, 20 us before "c" in the
    # second; "x" overlaps "a" on another stream (no gap). Per call: span, idle and the largest gap.
    from mok_plugin.bench.breakdown import idle_gaps, print_breakdown

    spans = [(0, 50, "a"), (10, 40, "x"), (150, 200, "b"), (200, 300, "c"),
             (1000, 1050, "a"), (1150, 1200, "b"), (1220, 1300, "c")]  # fmt: skip
    gaps = idle_gaps(spans, iters=2)
    assert gaps["span_ms"] == pytest.approx(0.65) and gaps["idle_ms"] == pytest.approx(0.46)
    largest = [(round(g["ms"], 6), g["after"], g["before"]) for g in gaps["largest"]]
    assert largest == [(0.35, "c", "a"), (0.1, "a", "b"), (0.01, "b", "c")]
    assert idle_gaps([], iters=3) == {"span_ms": 0.0, "idle_ms": 0.0, "largest": []}
    row = {"shape": "tiny", "routing": "uniform", "provider": "mok-multi", "fwd+bwd": {"ms": 0.7},
           "kernels": [{"kernel": "a", "ms": 0.1, "launches": 1}], "idle": gaps}  # fmt: skip
    print_breakdown(row)
    out = capsys.readouterr().out
    assert "idle between kernels 0.460 ms of a 0.65 ms span per call" in out and "after c  before a" in out


def test_the_profile_keeps_the_kernels_after_the_mark_only():
    # kernel_breakdown leaves its first profiled call out: torch.cuda._sleep's kernel marks where
    # the measured calls begin; without a mark every event is kept (None tells the caller).
    from mok_plugin.bench.breakdown import MARK_KERNEL, after_mark

    events = [(0, "a"), (90, "b"), (200, f"void {MARK_KERNEL}(long)"), (300, "a"), (350, "b"), (400, "a")]
    kept = after_mark(events, name=lambda e: e[1], start=lambda e: e[0])
    assert kept == [(300, "a"), (350, "b"), (400, "a")]
    assert after_mark(events[:2], name=lambda e: e[1], start=lambda e: e[0]) is None


class NoProfile(contextlib.nullcontext):
    """torch.profiler.profile's stand-in: a profile that records nothing."""

    def __init__(self, **kwargs):
        super().__init__(self)

    def events(self):
        return []


def test_the_process_first_profile_is_taken_and_dropped(monkeypatch):
    # The process's first profile reads its kernels low (session 53: 7.94 against 8.14 ms on
    # qwen3-30b-a3b in the next one), so kernel_breakdown takes one more the first time, dropped:
    # the work runs twice as often in the first call as in each later one.
    from mok_plugin.bench import breakdown

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.profiler, "profile", NoProfile)  # a CPU-only torch profiles no CUDA
    monkeypatch.setattr(breakdown, "_profiled", False)
    counts = []
    for _ in range(3):
        calls = []
        breakdown.kernel_breakdown(lambda calls=calls: calls.append(1), iters=2)
        counts.append(len(calls))
    assert counts == [2 * counts[1], counts[1], counts[1]] and counts[1] == 3  # the left-out call and two


def test_the_weights_are_drawn_an_expert_at_a_time_at_their_scale():
    # bf16 N(0, 1 / fan-in), seeded, a different draw for each expert (drawn an expert at a time, so
    # that the 384-expert shape's fp32 draws fit an 80 GB GPU)
    shape = MoEShape(8, 256, 128, 3, 2)
    first, again = (providers.make_inputs(shape, "uniform", 3, device="cpu") for _ in range(2))
    for name, size, fan_in in (("gate_up_proj", (3, 256, 256), 256), ("down_proj", (3, 256, 128), 128)):
        w = first[name]
        assert w.dtype == torch.bfloat16 and w.shape == size and torch.equal(w, again[name])
        assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
        assert w.float().std().item() * fan_in**0.5 == pytest.approx(1.0, abs=0.05)


def test_a_kernels_name_fits_its_column_and_keeps_what_tells_it_apart():
    # PyTorch's elementwise kernels are templates of hundreds of characters (as a profile on the H200
    # names them): the printed label keeps the outer name and the functor; short names stay whole
    from mok_plugin.bench.breakdown import short_kernel_name

    copy = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
            "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}"
            "::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&)::{lambda(int)#1}>"
            "(int)")  # fmt: skip
    fill = ("void at::native::vectorized_elementwise_kernel<2, at::native::FillFunctor<long>, std::array<char*, "
            "1ul> >(int, at::native::FillFunctor<long>, std::array<char*, 1ul>)")  # fmt: skip
    assert short_kernel_name(copy) == "at::native::elementwise_kernel<direct_copy_kernel_cuda>"
    assert short_kernel_name(fill) == "at::native::vectorized_elementwise_kernel<FillFunctor>"
    assert short_kernel_name("_expert_wgrad_kernel") == "_expert_wgrad_kernel"
    cut = short_kernel_name("void " + "x" * 80 + "<int>", width=20)
    assert len(cut) == 20 and cut.endswith("…")


def test_settle_stops_at_its_calls_cap_or_its_time(monkeypatch):
    # the profile's second settling (after the profiler's start) is capped in calls, so that short work
    # does not fill the profile with events; without a cap it runs its time
    from mok_plugin.bench.timing import settle

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    settle(lambda: calls.append(1), 60.0, max_calls=7)
    assert len(calls) == 7
    calls.clear()
    settle(lambda: calls.append(1), 0.02)
    assert len(calls) > 7
    calls.clear()
    settle(lambda: calls.append(1), 0.0, max_calls=7)
    assert calls == []


def test_graph_replay_rows_print_with_their_ratio_or_why_not(capsys):
    # --graphs: forward + backward replayed from a CUDA graph, a pass of its own with fwd+bwd's FLOPs
    # and its ratio to the PyTorch path's replay; a provider that cannot be captured says why.
    timing = {"ms": 2.0, "p20": 1.9, "p80": 2.1}
    common = {"shape": "tiny", "dims": [64, 32, 16, 4, 2], "routing": "uniform", "error": None, "bitwise": True,
              "peak_mib": 1.0, **{p: timing for p in layer.PASSES}}  # fmt: skip
    rows = [
        {**common, "provider": "mok-multi", layer.GRAPH_PASS: {"ms": 0.5, "p20": 0.5, "p80": 0.5}},
        {**common, "provider": "torch", layer.GRAPH_PASS: {"ms": 1.0, "p20": 1.0, "p80": 1.0}},
        {**common, "provider": "megatron", "graph_error": "operation not permitted when stream is capturing"},
    ]
    layer.print_table(rows, gemm=100.0)
    lines = capsys.readouterr().out.splitlines()
    graph_lines = [line for line in lines if "fwd+bwd graph" in line]
    assert len(graph_lines) == 3
    assert graph_lines[0].split()[3:6] == ["mok-multi", "fwd+bwd", "graph"] and "2.00x" in graph_lines[0]
    assert "not captured (operation not permitted when stream is capturing)" in graph_lines[2]


def test_the_floor_counts_weights_read_twice_where_routed_every_gradient_and_the_activations_once():
    # qwen3-30b-a3b's dimensions at T = 1: 8 experts routed to of 128 (BENCHMARKS.md, "The floors":
    # 1.21 GB of weight gradients, ~0.15 GB of weights read)
    shape = MoEShape(1, 2048, 768, 128, 8)
    per_expert = 3 * 2048 * 768  # SwiGLU: W13 (2I x H) and W2 (H x I)
    want = 2 * (2 * 8 * per_expert + 128 * per_expert + 4 * 2048)
    assert floor_bytes(shape, 8) == want
    assert round(128 * per_expert * 2 / 1e9, 2) == 1.21
    biased = MoKExpertFamily("glu", fc1_bias=True, fc2_bias=True)
    assert floor_bytes(shape, 8, biased) - floor_bytes(shape, 8) == 2 * (2 * 8 + 128) * (2 * 768 + 2048)
    linear = MoKExpertFamily("linear")
    assert floor_bytes(MoEShape(4, 64, 64, 4, 2), 2, linear) == 2 * ((2 * 2 + 4) * 64 * 64 + 4 * 4 * 64)
    with pytest.raises(ValueError, match="used_experts"):
        floor_bytes(shape, 129)
    assert routed_experts(torch.tensor([[3, 5], [5, 7], [3, 7]])) == 3


def test_graph_rows_print_against_their_floor(capsys):
    timing = {"ms": 0.6, "p20": 0.6, "p80": 0.6}
    row = {"shape": "tiny", "routing": "uniform", "provider": "mok-multi", layer.GRAPH_PASS: timing,
           "floor_bytes": 1_200_000_000}  # fmt: skip
    eager_only = {k: v for k, v in row.items() if k != layer.GRAPH_PASS}  # no replay: no floor line
    layer.print_floors([row, eager_only], copy=4.0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "0.600 ms against the floor 0.300 ms (1.20 GB at 4.00 TB/s): 2.00x" in lines[0]


def test_rows_their_bytes_bound_print_against_that_bound(capsys):
    # 4096,7168,2048,384,8 at 660 TFLOP/s and 4.0 TB/s: 13.12 ms of FLOPs, 101.7 GB in 25.43 ms, so at
    # most 52 % of dense; a row at 40.0 ms is 33 % of dense, 64 % of that bound (25.43 / 40.0). qwen3's FLOPs outlast
    # its bytes: no line.
    shape = MoEShape(4096, 7168, 2048, 384, 8)
    common = {"routing": "uniform", "provider": "mok-multi", "error": None}
    held = {**common, "shape": "kimi", "dims": list(shape.as_tuple()), "fwd+bwd": {"ms": 40.0},
            "floor_bytes": floor_bytes(shape, 384)}  # fmt: skip
    qwen3 = MoEShape(16384, 2048, 768, 128, 8)
    free = {**common, "shape": "qwen3", "dims": list(qwen3.as_tuple()), "fwd+bwd": {"ms": 8.0},
            "floor_bytes": floor_bytes(qwen3, 128)}  # fmt: skip
    wrong = {**held, "error": "max |diff| 1.0"}
    layer.print_bounds([held, free, wrong], gemm=660.0, copy=4.0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi")
    assert "fwd+bwd 33 % of dense; its bytes allow 52 % (101.7 GB at 4.00 TB/s against 13.12 ms of FLOPs)" in lines[0]
    assert lines[0].endswith(": 64 % of that bound")


def test_set_holds_its_value_for_the_whole_run_and_is_undone_after(monkeypatch):
    from mok_plugin.kernels import grouped_mlp

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(layer, "_run", lambda *args: seen.append(grouped_mlp.SWEEP_KEEPS_ONE_STEP_LEFT) or 0)
    before = grouped_mlp.SWEEP_KEEPS_ONE_STEP_LEFT
    switch = "mok_plugin.kernels.grouped_mlp.SWEEP_KEEPS_ONE_STEP_LEFT"
    assert layer.main(["--shape", "1,64,32,4,2", "--set", f"{switch}={not before}"]) == 0
    assert seen == [not before] and grouped_mlp.SWEEP_KEEPS_ONE_STEP_LEFT == before
    with pytest.raises(SystemExit):  # an attribute the module lacks is refused before any work
        layer.main(["--shape", "1,64,32,4,2", "--set", "mok_plugin.kernels.grouped_mlp.NO_SUCH_SWITCH=1"])


class LabelClock:  # what bench/clocks.ClockLog summarises, without nvidia-smi
    def __init__(self, counts: dict | None = None):
        self.labels, self.active = [], []
        self.counts = {} if counts is None else counts  # samples a label, where a test counts them

    @contextlib.contextmanager
    def side(self, label):
        self.labels.append(label)
        self.active.append(label)
        yield
        self.active.remove(label)

    def summary(self):
        return {
            label: {"sm_mhz": 1404.0, "watts": 686.0, "samples": self.counts.get(label, 7)} for label in self.labels
        }


def test_each_providers_row_keeps_the_sm_clock_its_timings_ran_at(monkeypatch, capsys):
    import argparse

    from mok_plugin.experts import SWIGLU

    clock = LabelClock()
    monkeypatch.setattr(layer, "make_inputs", lambda *args, **kwargs: providers.make_inputs(SHAPE, "uniform", 0,
                                                                                             device="cpu"))  # fmt: skip
    given = []

    def timed_provider(name, *args):
        given.append(args[-2:])  # the clock log and the label to time under
        return {"provider": name, "error": None}

    monkeypatch.setattr(layer, "bench_provider", timed_provider)
    args = argparse.Namespace(providers=["torch"], iters=2, settle_s=0.0, graphs=False, profile=False,
                              host_profile=False, memory=False, rounds=1, seed=0)  # fmt: skip
    clock.labels.append("tiny swiglu uniform torch")  # as bench_provider's timing would
    rows = layer._bench_case(args, "tiny", SHAPE, "swiglu", SWIGLU, "uniform", clock)
    assert given == [(clock, "tiny swiglu uniform torch")]
    assert rows[0]["clock"] == {"sm_mhz": 1404.0, "watts": 686.0, "samples": 7}
    out = capsys.readouterr().out
    assert "tiny swiglu uniform torch: done in" in out and "SM clock 1404 MHz 686 W (7 samples)" in out
    rows = layer._bench_case(args, "tiny", SHAPE, "swiglu", SWIGLU, "uniform", None)
    assert rows[0]["clock"] is None


def test_a_provider_is_clocked_while_timed_not_while_checked(monkeypatch):
    # the check's host copies leave the GPU idle at its high clock: only the timings are sampled
    clock = LabelClock()

    def check(*args):
        assert clock.active == []
        return {"error": None, "bitwise": True}

    def time_passes(*args):
        assert clock.active == ["case torch"]
        return {"fwd+bwd": [1.0, 2.0]}

    monkeypatch.setattr(layer, "check_provider", check)
    monkeypatch.setattr(layer, "time_passes", time_passes)
    monkeypatch.setattr(layer, "fwd_bwd", lambda fn, inputs: None)
    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda: 0)
    row = bench_provider("torch", None, {}, SHAPE, [], iters=2, clock=clock, clock_label="case torch")
    assert clock.labels == ["case torch"] and row["fwd+bwd"]["ms"] == 1.5


def test_later_rounds_are_clocked_under_their_providers_label(monkeypatch):
    samples = {}
    clock = LabelClock(samples)

    def fake_time_passes(fn, inputs, iters, settle_s):
        samples[clock.active[-1]] = samples.get(clock.active[-1], 0) + 1  # timed under its row's label
        return {p: [1.0] * iters for p in ("forward", "backward", "fwd+bwd")}

    monkeypatch.setattr(layer, "time_passes", fake_time_passes)
    rows = [{"samples": {p: [1.0] for p in ("forward", "backward", "fwd+bwd")}, "clock_label": f"case {name}"}
            for name in ("mok-multi", "torch")]  # fmt: skip
    add_rounds([(row, None) for row in rows], {}, rounds=3, iters=2, settle_s=0.0, clock=clock)
    assert samples == {"case mok-multi": 2, "case torch": 2}
    assert rows[1]["clock"] == {"sm_mhz": 1404.0, "watts": 686.0, "samples": 2}
