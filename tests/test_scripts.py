"""The layer demo (scripts/demo.py on configs/small.yaml) runs, finds the two runs bitwise
equal and writes its JSON; bench_layer.py refuses to run without a GPU with a clear message;
patches.py --target checks the version of the package it is pointed at."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_demo_main_job(tmp_path):
    out = tmp_path / "demo.json"
    run = subprocess.run(
        [sys.executable, "scripts/demo.py", "--config", "configs/small.yaml", "--tokens", "64", "--iters", "2",
         "--device", "cpu", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "bitwise equal" in run.stdout
    result = json.loads(out.read_text())
    assert result["bitwise"] is True and result["mismatched"] == []
    assert [row["pass"] for row in result["rows"]] == ["forward", "backward*", "fwd+bwd"]
    assert all(row["ms"] > 0 for row in result["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_bench_layer_needs_a_gpu():
    run = subprocess.run([sys.executable, "scripts/bench_layer.py", "--shapes", "tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


def test_megatron_peer_matches_reference_on_cpu():
    # bench_layer's Megatron-Core peer: the stock MoELayer (allgather dispatcher on the CPU; the
    # benchmark uses alltoall on GPUs) with the benchmark's routing and weights, against the reference.
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")
    import torch.distributed as dist
    from megatron.core import parallel_state

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_layer

    from mok_plugin.testing import MoEShape

    shape = MoEShape(32, 64, 32, 4, 2)
    inputs = bench_layer.make_inputs(shape, "uniform", 0, device="cpu")
    try:
        layer = bench_layer.build_megatron_moe(shape, "allgather", torch.device("cpu"))
        got = bench_layer.fwd_bwd(bench_layer.megatron_run(layer, inputs, shape), inputs)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    want = bench_layer.fwd_bwd(bench_layer.provider_reference(inputs, shape), inputs)
    assert bench_layer.check(got, want, shape) is None


def test_peak_live_set_finds_the_peak_and_who_allocated_it():
    # bench_layer --memory: a synthetic allocator trace whose peak is the second of three moments.
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_layer

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
        {"action": "alloc", "addr": 4, "size": 400, "frames": [frame("/x/scripts/bench_layer.py", 7, "run")]},
    ]
    peak, live = bench_layer.peak_live_set(trace)
    assert peak == 1000  # 300 + 500 + 200, before the free; the later 300 + 200 + 400 is less
    assert live == [
        {"bytes": 300, "site": "ops.py:5 fwd"},  # the project's frame, not torch's
        {"bytes": 500, "site": "functional.py:10 linear"},
        {"bytes": 200, "site": "?"},
    ]


def test_multi_gpu_smoke_on_cpu(tmp_path):
    # scripts/multi_gpu.py with two gloo processes: the invariance part (EP 1 and 2 bitwise, both
    # exchanges) and bench_ep at EP = 2, each a torchrun job; its JSON holds every part.
    run = subprocess.run(
        [sys.executable, "scripts/multi_gpu.py", "--cpu", "--nprocs", "2", "--invariance-shape", "64,32,16,8",
         "--bench-shapes", "64,32,16,8,2", "--tokens-per-gpu", "32", "--iters", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "multi_gpu.json").read_text())
    rows = result["invariance"]["rows"]
    assert result["invariance"]["status"] == "passed"
    assert {r["ep"] for r in rows} == {1, 2} and {r["exchange"] for r in rows} == {"capacity", "exact"}
    assert all(r["bitwise"] for r in rows)
    (bench,) = result["bench"]
    assert bench["status"] == "ran" and set(bench["per_rank"]) == {"0", "1"}
    assert bench["slowest_rank_median"]["dispatch"] > 0 and bench["per_rank"]["0"]["bytes"] > 0


def test_bench_deepspeed_smoke_on_cpu(tmp_path):
    # scripts/bench_deepspeed.py --tiny: stock and MoK DeepSpeed MoE layers train the same tiny model
    # from the same weights on the same data (k = 3: the aux losses agree too).
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")
    out = tmp_path / "ds.json"
    run = subprocess.run([sys.executable, "scripts/bench_deepspeed.py", "--tiny", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stock, mok = json.loads(out.read_text())["results"]
    assert (stock["variant"], mok["variant"]) == ("stock", "mok")
    assert len(mok["losses"]) == 3 and mok["tokens_per_s"] > 0
    assert abs(mok["losses"][0] - stock["losses"][0]) < 1e-4 * abs(stock["losses"][0])


def test_inspect_kernels_compiles_for_hopper_without_a_gpu():
    # scripts/inspect_kernels.py compiles for sm_90 on the CPU (outside Triton's interpreter, which
    # the test session turns on); a pre-gathered weight gradient has no by-token operand, so its K
    # loop gets at least the buffers of the gathered one.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "scripts/inspect_kernels.py", "--kernels", "wgrad_gate_up", "--candidates", "128x128x64w8s4",
         "128x128x64w8s4g"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    # the two candidates' rows (the pinned config's row is marked)
    rows = [
        line.split() for line in run.stdout.splitlines() if line.startswith("wgrad_gate_up") and "(pinned)" not in line
    ]
    # kernel, config (three words, four with "gather"), buffers, async copies, smem KiB, note
    buffers = {"gather" in row: int(row[5] if "gather" in row else row[4]) for row in rows}
    assert set(buffers) == {False, True}, run.stdout
    assert 1 <= buffers[False] <= buffers[True] <= 4, run.stdout
    pinned = next(line for line in run.stdout.splitlines() if "(pinned)" in line)
    assert "tma" in pinned and "compile failed" not in pinned  # TMA configs compile with descriptor arguments


def test_inspect_kernels_pipeline_report_parses_ttgir():
    sys.path.insert(0, str(ROOT / "scripts"))
    import inspect_kernels

    ttgir = (
        "%a = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>\n"
        "%b = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared1, #smem, mutable>\n"
        "%c = ttg.async_copy_global_to_local %p, %a\n"
        "%d = ttg.local_alloc %t : (tensor<64x128xbf16, #blocked>) -> !ttg.memdesc<64x128xbf16, #shared, #smem>\n"
    )
    assert inspect_kernels.pipeline_report(ttgir) == {"buffers": 3, "async_copies": 1, "register_operands": 1}


MEGATRON_0_18_1 = "MAJOR = 0\nMINOR = 18\nPATCH = 1\nPRE_RELEASE = ''\n"


@pytest.mark.parametrize(
    "framework, files, found",
    [
        pytest.param("megatron", {"megatron/core/package_info.py": MEGATRON_0_18_1}, "megatron-core 0.18.1",
                     id="megatron_version_file"),
        pytest.param("deepspeed", {"deepspeed/git_version_info_installed.py": "version='0.18.4'\n"},
                     "deepspeed 0.18.4", id="deepspeed_version_file"),
        pytest.param("megatron", {"megatron/core/__init__.py": "", "megatron_core-0.20.0.dist-info/METADATA":
                     "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n"}, "megatron-core 0.20.0",
                     id="megatron_dist_info"),
    ],
)  # fmt: skip
def test_patches_target_of_another_version_is_refused(tmp_path, framework, files, found):
    sys.path.insert(0, str(ROOT / "scripts"))
    import patches

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for action in ("apply", "check", "revert"):
        assert patches.main([action, framework, "--target", str(tmp_path)]) == 2
    run = subprocess.run([sys.executable, "scripts/patches.py", "apply", framework, "--target", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and found in run.stderr and "these patches are for 0.19.x" in run.stderr


def test_patches_target_without_a_version_is_refused(tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    run = subprocess.run([sys.executable, "scripts/patches.py", "apply", "megatron", "--target", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "cannot tell which megatron-core version" in run.stderr
