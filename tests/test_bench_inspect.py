"""`mok bench inspect` compiles the kernels for Hopper (sm_90) on a machine without a GPU and reads
how deep each K loop is pipelined from the TTGIR."""

import json

from triton_cases import outside_the_interpreter

from mok_plugin.bench.inspect import pipeline_report


def test_inspect_kernels_compiles_for_hopper_without_a_gpu():
    # Outside Triton's interpreter (which the test session turns on), so in its own process; a
    # pre-gathered weight gradient has no by-token operand, so its K loop gets at least the buffers
    # of the gathered one.
    stdout = outside_the_interpreter("-m", "mok_plugin.cli", "bench", "inspect", "--kernels", "wgrad_gate_up",
                                     "--candidates", "128x128x64w8s4", "128x128x64w8s4g")  # fmt: skip
    # the two candidates' rows (the pinned config's row is marked)
    rows = [line.split() for line in stdout.splitlines() if line.startswith("wgrad_gate_up") and "(pinned)" not in line]
    # kernel, config (three words, four with "gather"), buffers, async copies, smem KiB, note
    buffers = {"gather" in row: int(row[5] if "gather" in row else row[4]) for row in rows}
    assert set(buffers) == {False, True}, stdout
    assert 1 <= buffers[False] <= buffers[True] <= 4, stdout
    pinned = next(line for line in stdout.splitlines() if "(pinned)" in line)
    assert "tma" in pinned and "compile failed" not in pinned  # TMA configs compile with descriptor arguments


def test_pipeline_report_parses_ttgir():
    ttgir = (
        "%a = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>\n"
        "%b = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared1, #smem, mutable>\n"
        "%c = ttg.async_copy_global_to_local %p, %a\n"
        "%d = ttg.local_alloc %t : (tensor<64x128xbf16, #blocked>) -> !ttg.memdesc<64x128xbf16, #shared, #smem>\n"
    )
    assert pipeline_report(ttgir) == {"buffers": 3, "async_copies": 1, "register_operands": 1}


def test_sizes_that_are_multiples_of_8_but_not_16_keep_vector_loads(tmp_path):
    # H = 3000 or I = 1000: Triton knows nothing of an integer argument not divisible by 16, and the
    # row GEMMs' loads went 2 bytes wide, unpipelined, with spills (gate_up_fwd 24.5 ms vs 1.3 on the
    # H200), and the weight gradient's store 2 bytes wide (the sweep spilled). Restated as multiples
    # of ALIGN (tiles.aligned), they compile as the aligned shapes do.
    kernels = ["gate_up_fwd", "down_fwd", "down_dgrad", "wgrad_down"]
    stdout = outside_the_interpreter("-m", "mok_plugin.cli", "bench", "inspect", "--align", "8", "--kernels", *kernels,
                                     "--dump", str(tmp_path))  # fmt: skip
    assert "divisible by 8, not 16" in stdout
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] and line.split()[0] in kernels]
    assert len(rows) == 6, stdout  # wgrad_down: pre-gathered, in the loop, and the sweep
    for fields in rows:
        # kernel, config words (..., sN, ...), buffers, async copies, smem KiB, regs, stack, (pinned)
        stages = next(int(word[1:]) for word in fields if word[0] == "s" and word[1:].isdigit())
        end = fields.index("(pinned)")
        assert int(fields[end - 5]) == stages and int(fields[end - 1]) == 0, fields  # pipelined, no spills
    ptx = list(tmp_path.glob("*.ptx"))
    assert len(ptx) == 6, ptx  # wgrad_down: pre-gathered, in the loop, and the sweep
    for path in ptx:
        # no 2-byte loads, nor 2-byte stores (the weight gradient's before its row stride was restated)
        assert "ld.global.b16" not in path.read_text() and "st.global.b16" not in path.read_text(), path.name


def test_bias_gradient_kernels_and_megakernels_keep_vector_loads_at_sizes_that_are_multiples_of_8():
    # The kernels outside the tile table restate their sizes and strides through ALIGN too (a family
    # with biases, or the megakernel, at H = 3000): without it, at ALIGN 8, the bias-gradient
    # kernel's row loads went 2 bytes wide (32 in its PTX, no vector load) and the megakernels had
    # 256-400 two-byte loads and ran unpipelined (48 KiB of shared memory instead of 144-192).
    # Compiled in a process of its own: the tests run kernels interpreted.
    code = """
import json
from mok_plugin.bench.inspect import compile_jit_for_hopper
from mok_plugin.kernels import grouped_mlp as gm, megakernel as mk
tiles = dict(K=8, TILE_M=128, BLOCK_M=128, BLOCK_K=64, GROUP_M=8, COMBINE_BM=8, COMBINE_BN=256, DOT_PRECISION="tf32")
kernels = [(gm._bias_grad_kernel, {"BY_TOKEN": True, "BLOCK_K": 32, "BLOCK_N": 128}, (), 4),
           (gm._bias_router_grad_kernel, {"TILE_M": 128, "BLOCK_M": 32, "BLOCK_N": 128}, ("slot",), 4),
           (mk._forward_megakernel, dict(tiles, BN_GATE_UP=128, BN_DOWN=256), (), 8),
           (mk._backward_megakernel, dict(tiles, BN_DGRAD=64, BN_DX=256, WG_BM=128, WG_BN=128, WG_BK=64,
                                          ROUTER_BLOCK=128), ("T", "E", "NUM_ROWS"), 8)]
counts = {}
for fn, constexprs, scalars, warps in kernels:
    for align in (16, 8):
        compiled = compile_jit_for_hopper(fn, constexprs, align, scalars=scalars, num_warps=warps, num_stages=3)
        ptx = compiled.asm["ptx"]
        counts[f"{fn.__name__} {align}"] = [ptx.count("ld.global.b16"), ptx.count("st.global.b16"),
                                            ptx.count("ld.global.v"), compiled.metadata.shared]
print(json.dumps(counts))
"""
    counts = json.loads(outside_the_interpreter("-c", code, timeout=600).splitlines()[-1])
    for name in ("_bias_grad_kernel", "_bias_router_grad_kernel", "_forward_megakernel", "_backward_megakernel"):
        assert counts[f"{name} 8"] == counts[f"{name} 16"] and counts[f"{name} 8"][2] > 0, counts


def test_megakernels_fit_hoppers_shared_memory_in_every_dtype_at_their_launch_stages():
    # The forward megakernel launched gate_up_fwd's pinned stages whatever the dtype: pinned at 4 for
    # 2-byte inputs, its fp32 launch asked 288 KiB of shared memory and failed on an H100 (session 50).
    # Each megakernel compiled for sm_90 at the stages its launcher passes, with the pinned tiles, in bf16
    # and fp32 (the data pointers of that type), must fit 227 KiB. In a process of its own (see above).
    code = """
import json
from mok_plugin.bench.inspect import INT32_POINTERS, INT64_POINTERS, FP32_POINTERS, SMEM_LIMIT, _is_pointer
from mok_plugin.bench.inspect import compile_jit_for_hopper
from mok_plugin.kernels import megakernel as mk
import torch
H, I = 2048, 768
# what each launcher passes: its tiles and launch options (stages: gate_up_fwd's forward, megakernel_wgrad's back)
launches = [(mk._forward_megakernel, mk.forward_launch, ()),
            (mk._backward_megakernel, mk.backward_launch, ("T", "E", "NUM_ROWS"))]
shared = {}
for fn, launch_of, scalars in launches:
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        constexprs = dict(launch_of(H, I, dtype), K=8, TILE_M=128)
        warps, stages = constexprs.pop("num_warps"), constexprs.pop("num_stages")
        data = {arg: f"*{name}" for arg in fn.arg_names if _is_pointer(arg) and arg not in constexprs
                and arg not in INT64_POINTERS | INT32_POINTERS | FP32_POINTERS}
        compiled = compile_jit_for_hopper(fn, constexprs, 16, scalars=scalars, num_warps=warps, num_stages=stages,
                                          pointer_types=data)
        shared[f"{fn.__name__} {name} s{stages}"] = compiled.metadata.shared
print(json.dumps({"limit": SMEM_LIMIT, "shared": shared}))
"""
    report = json.loads(outside_the_interpreter("-c", code, timeout=900).splitlines()[-1])
    assert len(report["shared"]) == 4, report
    for launch, used in report["shared"].items():
        assert 0 < used <= report["limit"], (launch, report)
