"""Compile the layer's Triton kernels for Hopper (sm_90) without a GPU and report how each K loop is
software-pipelined: how many shared-memory buffers its operands get, whether the loads are
asynchronous copies, the shared memory per program, and registers and spill stack per thread
(from the cubin). Costs no device time.

    mok bench inspect                                                  # the pinned configs
    mok bench inspect --candidates 128x128x64w8s4 128x128x64w8s4g --dump out/ttgir
    mok bench inspect --align 8          # as for H or I a multiple of 8 but not 16 (H = 3000)
(`python scripts/inspect_kernels.py ...` is the same command.)

Compiled as the launcher specialises a real call: bf16 operands, 16-byte aligned pointers and
integer arguments divisible by 16; with a TMA config, the operands the launcher would hand over as
tensor descriptors are descriptor-typed. Use the device's Triton version for numbers that match it
(3.6 on the H200 here; the shared-memory figures agreed with the device's compiled-kernel report).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mok_plugin.bench.tuning import parse_tile_config, tile_config_label
from mok_plugin.kernels import grouped_mlp as gm
from mok_plugin.kernels.configs import MoKTileConfig, interpreter_on, kernel_config
from mok_plugin.kernels.launch import is_size_or_stride

__all__ = [
    "compile_for_hopper",
    "compile_fp8_fc1_hopper",
    "compile_fp8_hopper",
    "compile_gluon_for_hopper",
    "compile_jit_for_hopper",
    "compile_rows_hopper",
    "compile_wgrad_hopper",
    "main",
    "pipeline_report",
    "resource_usage",
]

KERNELS = ("gate_up_fwd", "down_fwd", "down_dgrad", "gate_up_dgrad", "wgrad_down", "wgrad_gate_up")

HOPPER = GPUTarget("cuda", 90, 32)
INT64_POINTERS = {"row_to_token_ptr", "row_to_tk_ptr", "expert_offsets_ptr", "tokens_per_expert_ptr",
                  "tile_to_expert_ptr", "tk_to_row_ptr"}  # fmt: skip
INT32_POINTERS = {"counters_ptr"}  # the megakernels' tickets
# d_a_ptr: down_dgrad's fp32 dA'; scale_ptr: the routing weights a bias gradient scales rows by
FP32_POINTERS = {"topk_weights_ptr", "d_w_partial_ptr", "d_a_ptr", "scale_ptr", "partial_ptr", "d_topk_ptr"}
WIDE = 4096  # an output width that no pinned config narrows for
SMEM_LIMIT = 227 * 1024  # shared memory one program may use on Hopper


def _kernel_and_constexprs(kernel: str, cfg: MoKTileConfig) -> tuple[object, dict]:
    """The jit function behind a kernel name and the constexpr arguments its launcher passes."""
    common = {"BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "DOT_PRECISION": "tf32",
              "TMA": cfg.tma, "ALIGN": 16}  # fmt: skip
    row_tiles = dict(common, TILE_M=128, BLOCK_N=cfg.block_n)
    # down_dgrad: its GEMM (the elementwise epilogue kernel that follows it is not inspected)
    row_kernels = {"gate_up_fwd": gm._gate_up_fwd_kernel, "down_fwd": gm._down_fwd_kernel,
                   "down_dgrad": gm._down_dgrad_gemm_kernel, "gate_up_dgrad": gm._gate_up_dgrad_kernel}  # fmt: skip
    if kernel == "gate_up_fwd":  # a bias-free SwiGLU expert's, h per row (the large batches')
        return row_kernels[kernel], dict(row_tiles, b1_ptr=None, ACT="silu", GATED=True, CLAMP=None, OFFSET=0.0,
                                         H_BY_PAIR=False, JOINED=gm.gate_up_joined(True, cfg.tma))  # fmt: skip
    if kernel == "down_fwd":
        return row_kernels[kernel], dict(row_tiles, b2_ptr=None)
    if kernel == "gate_up_dgrad":
        return row_kernels[kernel], dict(row_tiles, H_BY_PAIR=False)
    if kernel in row_kernels:
        return row_kernels[kernel], row_tiles
    # expert_wgrad launches dW13 with its operands swapped, so the by-token one is the left in both;
    # pre-gathered rows turn it into a by-row one.
    # (dW2's launch: its output columns are contiguous, a stride Triton specialises as the constant 1)
    return gm._expert_wgrad_kernel, dict(common, BLOCK_N=cfg.block_n, LEFT_BY_TOKEN=not cfg.gather_rows,
                                         RIGHT_BY_TOKEN=False, SWEEP=cfg.sweep, D_W_TRANSPOSED=False,
                                         RIGHT_INDEX_DIVISOR=1,
                                         KEEP_ONE_STEP_LEFT=cfg.sweep and gm.SWEEP_KEEPS_ONE_STEP_LEFT,
                                         stride_d_w_n=1)  # fmt: skip


def _descriptor_blocks(kernel: str, cfg: MoKTileConfig) -> dict[str, list[int]]:
    """The arguments a TMA launch passes as tensor descriptors, with their block shapes (as the
    launchers in grouped_mlp.py build them)."""
    if not cfg.tma:
        return {}
    m, n, k = cfg.block_m, cfg.block_n, cfg.block_k
    blocks = {
        "gate_up_fwd": {"w13": [2, n, k] if gm.gate_up_joined(True, cfg.tma) else [n, k]},
        "down_fwd": {"a": [m, k], "w2": [n, k]},
        "down_dgrad": {"w2": [k, n]},
        "gate_up_dgrad": {"d_h": [m, k], "w13": [k, n]},
        # only by-row operands: with pre-gathered rows both are
        "wgrad_down": {"right": [k, n]} | ({"left": [k, m]} if cfg.gather_rows else {}),
        "wgrad_gate_up": {"right": [k, n]} | ({"left": [k, m]} if cfg.gather_rows else {}),
    }
    return blocks[kernel]


def _is_pointer(name: str) -> bool:
    """The kernels' naming: pointers end in _ptr, operands that may come as a tensor descriptor (TMA)
    are bare lowercase names (w13, a, left); sizes are UPPER_CASE and strides stride_*."""
    return name.endswith("_ptr") or not (name.isupper() or name.startswith("stride_"))


def compile_for_hopper(kernel: str, cfg: MoKTileConfig, align: int = 16):
    """`kernel` compiled for sm_90 as its launcher would specialise a bf16 call with `cfg`; with
    align < 16, as for sizes and strides that are multiples of `align` but not of 16 (H = 3000:
    8), which Triton then knows nothing about, and ALIGN = align (launch.alignment)."""
    fn, constexprs = _kernel_and_constexprs(kernel, cfg)
    return compile_jit_for_hopper(fn, constexprs, align, _descriptor_blocks(kernel, cfg), num_warps=cfg.num_warps,
                                  num_stages=cfg.num_stages)  # fmt: skip


def compile_jit_for_hopper(fn, constexprs: dict, align: int = 16, descriptors: dict | None = None,
                           scalars: tuple[str, ...] = (), num_warps: int = 8, num_stages: int = 3,
                           pointer_types: dict[str, str] | None = None):  # fmt: skip
    """A jit function compiled for sm_90 with these constexprs (and ALIGN = align if it takes one), its other
    arguments typed by the kernels' naming: bf16 pointers but the int64, int32 and fp32 ones named above
    and those `pointer_types` names (e.g. {"data_ptr": "*fp8e4nv"}), `descriptors` as tensor descriptors
    of those block shapes, 32-bit sizes and strides divisible by 16 only when align is 16, and
    `scalars` as plain 32-bit integers."""
    pointer_types = pointer_types or {}
    constexprs = dict(constexprs, ALIGN=align) if "ALIGN" in fn.arg_names else constexprs
    descriptors = descriptors or {}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in descriptors:
            signature[name] = f"tensordesc<bf16{descriptors[name]}>"
            continue
        if name in scalars:
            signature[name] = "i32"
            continue
        if name in pointer_types:
            signature[name] = pointer_types[name]
        elif _is_pointer(name):
            signature[name] = ("*i64" if name in INT64_POINTERS else "*i32" if name in INT32_POINTERS
                               else "*fp32" if name in FP32_POINTERS else "*bf16")  # fmt: skip
        else:
            signature[name] = "i32"
        if align == 16 or not is_size_or_stride(name):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


def compile_gluon_for_hopper(kernel, descriptors: dict, pointers: dict[str, str | tuple[str, ...]],
                             scalars: tuple[str, ...], constexprs: dict, options: dict):  # fmt: skip
    """A Gluon kernel compiled for sm_90 as its launcher specialises a call: `descriptors` maps each
    descriptor argument to (element type as Triton spells it, block shape, shared layout), `pointers`
    each pointer argument to its type, or a tuple argument to its elements' types (pointers "*...",
    16-byte aligned; integers "i32"), `scalars` are 32-bit integers."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: f"tensordesc<{dtype}{list(block)},{layout!r}>" for name, (dtype, block, layout) in
                 descriptors.items()}  # fmt: skip
    signature |= pointers | dict.fromkeys(scalars, "i32") | dict.fromkeys(constexprs, "constexpr")
    args = kernel.arg_names
    attrs = {}
    for name, types in pointers.items():
        for path, kind in [((), types)] if isinstance(types, str) else [((j,), t) for j, t in enumerate(types)]:
            if kind.startswith("*"):
                attrs[(args.index(name), *path)] = [["tt.divisibility", 16]]
    source = GluonASTSource(kernel, {name: signature[name] for name in args}, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=options)


def compile_weight_quantiser(with_transpose: bool = True):
    """kernels/fp8.py's weight quantiser as quantize_fc1 launches it (bf16 weights into E4M3, a glu's
    two halves; with_transpose: the transposed copy stored too), compiled for sm_90."""
    from mok_plugin.fp8.recipe import E4M3
    from mok_plugin.kernels import fp8

    fp8_pointers = {"data_ptr": "*fp8e4nv", "data_t_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32"}
    constexprs = {"MAX": E4M3.max, "MANTISSA_BITS": E4M3.mantissa_bits, "MIN_NORMAL_EXPONENT": E4M3.min_normal_exponent,
                  "POWER_OF_2": True, "BLOCK": 128, "CHUNK": fp8.TILE_QUANTISER_CHUNK, "HALVES": 2}  # fmt: skip
    if not with_transpose:
        constexprs["data_t_ptr"] = None
    return compile_jit_for_hopper(fp8._quantize_tiles_kernel, constexprs, num_warps=fp8.TILE_QUANTISER_WARPS,
                                  pointer_types=fp8_pointers)  # fmt: skip


def compile_wgrad_hopper(schedule: str = "cooperative"):
    """The Gluon weight-gradient kernel (kernels/wgrad_hopper.py) under one of its SCHEDULES,
    compiled for sm_90 as its launcher specialises a bf16 call: descriptors of its block shapes
    and shared layouts, 16-byte aligned pointers, 32-bit sizes. Needs Triton's Gluon (ImportError
    without it)."""
    from triton.experimental.gluon import language as gl

    from mok_plugin.kernels import wgrad_hopper as wh

    plan = wh.SCHEDULES[schedule]
    blocks = {"left_desc": (wh.BLOCK_K, wh.BLOCK_M), "right_desc": (wh.BLOCK_K, plan.block_n),
              "out_desc": (1, wh.BLOCK_M, plan.block_n)}  # fmt: skip
    descriptors = {name: ("bf16", block, wh._layout(block, gl.bfloat16)) for name, block in blocks.items()}
    constexprs = {"C_LAYOUT": wh._layout((wh.BLOCK_M, plan.block_n), gl.bfloat16), "STAGES": plan.stages,
                  "LOADER_WARPS": wh.LOADER_WARPS, "LOADER_REGS": wh.LOADER_REGS}  # fmt: skip
    constexprs |= {"MMA_REGS": wh.PINGPONG_MMA_REGS} if plan.pingpong else {"num_warps": plan.num_warps}
    kernel = wh._wgrad_pingpong_kernel if plan.pingpong else wh._wgrad_kernel
    return compile_gluon_for_hopper(
        kernel, descriptors, {"offsets_ptr": "*i64", "counts_ptr": "*i64"}, ("M", "N", "num_tiles"), constexprs,
        {"num_warps": plan.num_warps, "maxnreg": wh.MAX_REGS},
    )  # fmt: skip


def compile_rows_hopper(
    schedule: str = "cooperative", b_k_major: bool = True, bias: bool = False, routing: bool = True
):
    """The Gluon row-GEMM kernel (kernels/rows_hopper.py) under one of wgrad_hopper's SCHEDULES, its
    weights K-major (fc2's forward, with its epilogue's bias and routing weights where asked) or
    N-major (fc1's dgrad), compiled for sm_90 as its launcher specialises a bf16 call. Needs Triton's
    Gluon (ImportError without it)."""
    from triton.experimental.gluon import language as gl

    from mok_plugin.kernels import rows_hopper as rh
    from mok_plugin.kernels import wgrad_hopper as wh

    kernel, constexprs, plan = rh.kernel_arguments(torch.bfloat16, schedule, b_k_major, bias, routing)
    blocks = {"a_desc": (rh.BLOCK_M, rh.BLOCK_K), "out_desc": (1, rh.BLOCK_M, plan.block_n),
              "b_desc": (plan.block_n, rh.BLOCK_K) if b_k_major else (rh.BLOCK_K, plan.block_n)}  # fmt: skip
    descriptors = {name: ("bf16", block, wh._layout(block, gl.bfloat16)) for name, block in blocks.items()}
    if not plan.pingpong:
        constexprs |= {"num_warps": plan.num_warps}
    pointers = {"tile_to_expert_ptr": "*i64", "epilogue": ("*bf16", "i32", "*fp32", "*i64")}
    return compile_gluon_for_hopper(kernel, descriptors, pointers, ("M", "N", "K", "tile_m", "num_tiles"), constexprs,
                                    {"num_warps": plan.num_warps, "maxnreg": wh.MAX_REGS})  # fmt: skip


def _fp8_descriptors(blocks: dict) -> dict:
    """compile_gluon_for_hopper's descriptors from {name: (torch dtype, block)}: the element type as
    Triton spells it (its Gluon dtype's name) and fp8_hopper's shared layout of the block."""
    from mok_plugin.kernels import fp8_hopper as fh

    return {name: (fh.GL_DTYPES[dtype].name, block, fh.shared_layout(block, dtype)) for name, (dtype, block) in
            blocks.items()}  # fmt: skip


def compile_fp8_hopper(kind: str = "wgrad", out_dtype: torch.dtype = torch.bfloat16,
                       a_dtype: torch.dtype = torch.float8_e4m3fn, b_dtype: torch.dtype = torch.float8_e4m3fn,
                       bias: bool = False, routing: bool = False, flat: bool = False):  # fmt: skip
    """The blockwise-FP8 Gluon kernel (kernels/fp8_hopper.py) for weight gradients ("wgrad", their loop
    `flat` or tile by tile) or row GEMMs ("rows", with fc2's epilogue's bias and routing weights where
    asked), compiled for sm_90 as its launcher specialises a call with these dtypes. Needs Triton's
    Gluon (ImportError without it)."""
    from mok_plugin.kernels import fp8_hopper as fh

    blocks = {f"a{half}_desc": (a_dtype, (fh.BLOCK_M, fh.BLOCK_K)) for half in "01"}
    blocks |= {f"b{half}_desc": (b_dtype, (fh.BLOCK_N, fh.BLOCK_K)) for half in "01"}
    if kind != "rows":  # the second halves' places: both operands' scales, a [1, 128] row of them a step
        blocks |= {"a1_desc": (torch.float32, (1, fh.BLOCK_M)), "b1_desc": (torch.float32, (1, fh.BLOCK_N))}
    blocks["out_desc"] = (out_dtype, (1, fh.HALF_M, fh.BLOCK_N))
    descriptors = _fp8_descriptors(blocks)
    kernel, constexprs = fh.kernel_arguments(out_dtype, kind == "rows", bias, routing, flat)
    if kind == "rows":  # tile_to_expert, k_steps, halves, tile_m, A's scales and strides, B's scales and strides
        work = ("*i64", "i32", "i32", "i32", "*fp32", "i32", "i32", "*fp32", "i32", "i32", "i32")
        epilogue = (f"*{fh.GL_DTYPES[out_dtype].name}", "i32", "*fp32", "*i64")
    else:  # offsets, counts
        work, epilogue = ("*i64", "*i64"), ()
    return compile_gluon_for_hopper(
        kernel, descriptors, {"work": work, "epilogue": epilogue}, ("M", "N", "num_tiles"), constexprs,
        {"num_warps": 4, "maxnreg": fh.MAX_REGS},
    )  # fmt: skip


def compile_fp8_fc1_hopper(out_dtype: torch.dtype = torch.bfloat16, fmt: str = "e4m3", bias: bool = False,
                           gated: bool = True, activation: str = "silu", clamp: float | None = None,
                           offset: float = 0.0):  # fmt: skip
    """fc1's blockwise-FP8 forward in Gluon (kernels/fp8_fc1_hopper.py), compiled for sm_90 as its
    launcher specialises a call: x and W13 in E4M3, h in out_dtype, A in `fmt`, the expert family's
    activation, clamp, offset and fc1 bias. Needs Triton's Gluon (ImportError without it)."""
    from mok_plugin.fp8.recipe import E4M3, E5M2
    from mok_plugin.kernels import fp8_fc1_hopper as f1
    from mok_plugin.kernels import fp8_hopper as fh

    a_format = {"e4m3": E4M3, "e5m2": E5M2}[fmt]
    half = (1, fh.HALF_M, fh.BLOCK_N)  # one warpgroup's output block
    blocks = {"x_desc": (torch.float8_e4m3fn, (fh.BLOCK_M, fh.BLOCK_K)),
              "w_desc": (torch.float8_e4m3fn, (fh.BLOCK_N, fh.BLOCK_K)),
              "h_gate_desc": (out_dtype, half), "h_up_desc": (out_dtype, half),
              "a_desc": (a_format.dtype, half)}  # fmt: skip
    descriptors = _fp8_descriptors(blocks)
    kernel, constexprs = f1.kernel_arguments(out_dtype, a_format.dtype, bias, gated, activation, clamp, offset,
                                             a_format, True)  # fmt: skip
    bias_ptr = f"*{fh.GL_DTYPES[out_dtype].name}" if bias else "*fp32"
    work = ("*i64", "i32", "i32", "i32", "*fp32", "i32", bias_ptr, "i32", "*fp32", "i32", "*fp32", "i32", "i32", "i32")
    return compile_gluon_for_hopper(
        kernel, descriptors, {"work": work}, ("I", "N1", "M", "num_tiles"), constexprs,
        {"num_warps": 4, "maxnreg": fh.MAX_REGS},
    )  # fmt: skip


def pipeline_report(ttgir: str) -> dict:
    """Operand buffers (the leading dimension of each multi-buffered shared allocation), the count
    of asynchronous global-to-shared copies, and how many register tensors are staged in shared
    memory (a wgmma operand that came through registers, or a TMA store's source)."""
    buffers = [int(n) for n in re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)]
    return {
        "buffers": max(buffers, default=1),
        "async_copies": len(re.findall(r"async_copy_global_to_local", ttgir)),
        "register_operands": len(re.findall(r"ttg\.local_alloc %\S+ : \(tensor", ttgir)),
    }


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread: spills live there) from the cubin, read by
    the cuobjdump that ships with Triton's NVIDIA backend."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (-1, -1)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of `mok bench inspect` (and scripts/inspect_kernels.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--kernels", nargs="*", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--candidates", nargs="*", type=parse_tile_config, default=[],
                        help="configs to compile besides the pinned ones (mok bench tune's notation)")  # fmt: skip
    parser.add_argument("--dump", type=Path, default=None, help="write each kernel's TTGIR and PTX here")
    parser.add_argument("--align", type=int, choices=(16, 8, 4, 2, 1), default=16,
                        help="compile as for sizes and strides divisible by this, not by 16 (H = 3000: 8)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Compile and report; 0 on success (a config the compiler rejects is a row, not a failure)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if interpreter_on():
        parser.error("TRITON_INTERPRET=1 runs kernels in the interpreter; unset it to compile them")
    print(f"Triton {triton.__version__}, target sm_90; 'buffers' = shared-memory stages the K loop's operands got"
          + (f"; sizes and strides divisible by {args.align}, not 16" if args.align < 16 else ""))  # fmt: skip
    print(f"{'kernel':<14} {'config':<30} {'buffers':>7} {'async copies':>12} {'smem KiB':>8} {'regs':>4} "
          f"{'stack B':>7}  note")  # fmt: skip
    for kernel in args.kernels:
        # the three pinned weight-gradient configs: pre-gathered (wide by-row operands), in the loop,
        # and the sweep (few rows per expert)
        entries = ("wgrad", "wgrad_in_loop", "wgrad_sweep") if kernel.startswith("wgrad") else (kernel,)
        pinned = [kernel_config(entry, WIDE) for entry in entries]
        for cfg in [*pinned, *args.candidates]:
            name = tile_config_label(cfg)
            if cfg.gather_rows and not kernel.startswith("wgrad"):
                continue  # an option that kernel does not take
            try:
                compiled = compile_for_hopper(kernel, cfg, args.align)
            except Exception as error:  # a config the compiler rejects
                print(f"{kernel:<14} {name:<30} compile failed: {type(error).__name__}")
                continue
            report = pipeline_report(compiled.asm["ttgir"])
            note = "(pinned)" if cfg in pinned else ""
            if report["register_operands"]:
                note += f" {report['register_operands']} register tensors staged in shared memory"
            if report["buffers"] < cfg.num_stages:
                note += f" pipelined {report['buffers']} deep, not {cfg.num_stages}"
            if compiled.metadata.shared > SMEM_LIMIT:
                note += " over Hopper's 227 KiB of shared memory: would not launch"
            regs, stack = resource_usage(compiled.asm["cubin"])
            if stack:
                note += f" spills ({stack} bytes of stack)"
            print(f"{kernel:<14} {name:<30} {report['buffers']:>7} {report['async_copies']:>12} "
                  f"{compiled.metadata.shared / 1024:>8.1f} {regs:>4} {stack:>7}  {note.strip()}")  # fmt: skip
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                stem = f"{kernel}-{name.replace(' ', '_')}"
                (args.dump / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
                (args.dump / f"{stem}.ptx").write_text(compiled.asm["ptx"])
    return 0
