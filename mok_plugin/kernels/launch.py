"""Host-side helpers every launcher shares: argument checks, TMA descriptors, dot precision, ALIGN,
pipelining depth per dtype, and `launch` (a Triton launch with less host work). No kernels, no
autograd, no host synchronisation."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator
from dataclasses import replace

import torch
from triton import knobs
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from mok_plugin.kernels.configs import MoKTileConfig, interpreter_on

try:  # Gluon's kernels: a JITFunction whose binder makes Gluon's source; launched as Triton's are
    from triton.experimental.gluon._runtime import GluonJITFunction
except ImportError:  # a Triton without Gluon
    GluonJITFunction = JITFunction

__all__ = [
    "alignment",
    "cdiv",
    "check_schedule",
    "check_tensor",
    "descriptor",
    "dot_precision",
    "is_size_or_stride",
    "launch",
    "next_power_of_2",
    "routing_weights_arg",
    "sm_count",
    "stages_for",
    "through_triton",
    "tma_ok",
]


def alignment(*values: int) -> int:
    """The kernels' ALIGN constexpr: the largest of 16, 8, 4, 2, 1 that divides every value (sizes
    and strides, in elements). Triton specialises an integer argument on divisibility by 16 and
    nothing less; a kernel restates its sizes and strides as multiples of ALIGN (`tiles.aligned`)
    so that H = 3000 or I = 1000 (multiples of 8) keep 16-byte loads and stores. On the H200 with
    H = 3000, gate_up_fwd took 24.5 ms against 1.3 ms at H = 3008, and down_fwd 14.4 ms against
    0.7 with I = 1000 against 1008 (8192 x 160 experts, K 6; the loads went 2 bytes wide, unpipelined)."""
    align = 16
    for value in values:
        while value % align:
            align //= 2
    return align


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of two host integers. Not `triton.cdiv`: that is a `constexpr_function` whose
    wrapper unwraps its arguments (~4 us of host a call, 14 calls a small step's fwd+bwd)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1; `triton.next_power_of_2` without its wrapper."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache  # asked for every argument of every row-tile launch (~64 names a small step)
def is_size_or_stride(name: str) -> bool:
    """Whether a kernel argument is one of the sizes and strides the kernels restate through ALIGN
    (their names: H, I, N, N1, M_OUT, N_OUT and stride_*)."""
    return name in ("H", "I", "N", "N1", "M_OUT", "N_OUT") or name.startswith("stride_")


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision for operands of `dtype`."""
    # fp32 operands would default to tf32 on the GPU; tests in fp32 need the full-precision path.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tensor(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError/TypeError naming `name` unless t is a contiguous `dim`-D tensor (of `dtype`)."""
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def routing_weights_arg(topk_weights: torch.Tensor) -> torch.Tensor:
    """The fp32 [T, K] routing weights as the kernels read them (flat, through row_to_tk), after
    checking them. With no pairs (an expert-parallel rank that receives none) every row is padding
    and nothing is read, but a kernel still needs a valid pointer: one zero stands in."""
    check_tensor("topk_weights", topk_weights, 2, torch.float32)
    return topk_weights if topk_weights.numel() else topk_weights.new_zeros(1, 1)


def check_schedule(row_to_token: torch.Tensor, tile_to_expert: torch.Tensor, tile_m: int, block_m: int) -> int:
    """The schedule's padded row count R_pad, after checking its maps fit row tiles of block_m rows.

    Raises:
        ValueError: a map has the wrong dtype or rank, or tile_m is not a multiple of BLOCK_M that
            divides R_pad with one tile_to_expert entry per tile.
    """
    check_tensor("row_to_token", row_to_token, 1, torch.int64)
    check_tensor("tile_to_expert", tile_to_expert, 1, torch.int64)
    num_rows = row_to_token.shape[0]
    if tile_m % block_m != 0 or num_rows % tile_m != 0 or tile_to_expert.shape[0] != num_rows // tile_m:
        raise ValueError(
            f"schedule tile_m={tile_m} must be a multiple of BLOCK_M={block_m} and divide num_rows={num_rows}, "
            f"with one tile_to_expert entry per tile (got {tile_to_expert.shape[0]})"
        )
    return num_rows


def tma_ok(cfg: MoKTileConfig, *tensors: torch.Tensor) -> bool:
    """Whether cfg asks for TMA and every tensor's shape can back a descriptor (unit column stride,
    row strides of a multiple of 16 bytes) on a GPU with the copy engine (Hopper or newer) or under
    Triton's interpreter. Shapes and the device decide, never the data pointer, so the choice is
    the same in every process; `descriptor` copies a tensor whose start is not 16-byte aligned."""
    if not cfg.tma:
        return False
    on_hopper = tensors[0].is_cuda and _has_copy_engine(tensors[0].get_device())
    if not on_hopper and not interpreter_on():  # in this order: the environment read costs ~4 us on the H200's host
        return False
    return all(t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


@functools.cache
def _has_copy_engine(device_index: int) -> bool:
    """Whether CUDA device `device_index` has TMA (Hopper or newer); cached, as the launchers ask
    at every launch (a device-properties call, a few us of host time)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def sm_count(device_index: int | None) -> int:
    """CUDA device `device_index`'s SM count; cached, as launchers ask at every launch."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def descriptor(t: torch.Tensor, block_shape: list[int], *, flatten: bool = True) -> TensorDescriptor:
    """A TMA descriptor over t viewed 2-D (a stacked weight [E, rows, cols] becomes [E * rows, cols]),
    or over t as it is (flatten=False)."""
    if t.data_ptr() % 16:
        t = t.clone()  # TMA needs a 16-byte aligned start; a fresh allocation has one
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]) if flatten else t, block_shape)


def stages_for(cfg: MoKTileConfig, dtype: torch.dtype) -> MoKTileConfig:
    """cfg for inputs of `dtype`. The pinned stages are sized for 2-byte inputs; fp32 tiles take
    twice the shared memory, which no longer fits Hopper's 227 KiB at the pinned depth (gate_up_dgrad
    would ask for 384 KiB), so fp32 (tests, checks) runs unpipelined. Tiles and K order stay, so the
    results are the same as at any depth."""
    return replace(cfg, num_stages=1) if dtype.itemsize > 2 else cfg


# Triton's own launch entry, to notice a stand-in (`mok bench host` replaces it to count launches).
_TRITON_GETITEM = JITFunction.__getitem__
# The kernel types whose binary `launch` launches directly: plain `triton.jit` and `gluon.jit` kernels
# (the same `run`, binder and launcher; Gluon's descriptors carry their shared layout, which is in
# the specialization and so in the binary's key). Of the Gluon kernels only rows_hopper's (off by
# default) comes here so far (session 59, written without a GPU); the weight-gradient and FP8 ones,
# on by default, keep `kernel[grid]` until the GPU tests have run this path on Gluon.
_DIRECT_TYPES = (JITFunction, GluonJITFunction)
# (kernel id, device, Triton's specialization of the arguments, the launch options) -> _Binary
_binaries: dict[tuple, _Binary] = {}
_direct = True  # False within `through_triton`


def launch(kernel: JITFunction, grid: tuple[int, ...], *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` with less of Triton's per-launch Python on a GPU.

    Small batches are bound by the host (BENCHMARKS.md, "Small batches with direct launches"):
    Triton 3.6's `JITFunction.run` reads its knobs from the environment, hashes the options, checks
    the kernel's globals and builds a launch-metadata dict for hooks at every launch. Here Triton's
    own binder binds and specialises the arguments (alignment, divisibility by 16, the value 1,
    dtypes: exactly what picks Triton's binary), and the binary Triton compiled for the same
    specialization and options is launched directly (`_Binary`): 21-29 us less a launch on the
    H200's host.

    These go through `kernel[grid]` unchanged: the first launch of each specialization (Triton
    compiles it), launches while Triton's launch hooks or the kernel's pre-run hooks are set
    (profilers), anything not a plain `triton.jit` or `gluon.jit` kernel (the interpreter's kernels,
    stand-ins), tracing under torch.compile, and launches within `through_triton`. Not seen after a
    specialization's first launch: Triton's debug and instrumentation knobs changed mid-process."""
    if (
        torch.compiler.is_compiling()
        or not _direct
        or type(kernel) not in _DIRECT_TYPES
        or JITFunction.__getitem__ is not _TRITON_GETITEM
        or not _hooks_idle(kernel)
    ):
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    bound, specialization, options = kernel.device_caches[device][4](*args, **kwargs)
    key = (id(kernel), device, *specialization, *options.items())
    binary = _binaries.get(key)
    if binary is None:
        _binaries[key] = _Binary(kernel, kernel[grid](*args, **kwargs))
        return
    binary.launch(grid, torch._C._cuda_getCurrentRawStream(device), bound.values())


class _Binary:
    """How one compiled kernel is launched directly.

    Through its `run` (Triton's launcher object) in general. With Triton 3.6's CUDA launcher, through
    the C function behind it, with the TMA descriptors' arguments filled once per (address, shape,
    strides, block) and kept: the launcher's Python (scratch allocators, a loop over every argument
    for the descriptors, a driver call per descriptor) cost 25-45 us a TMA launch on the H200's
    host (cProfile). A descriptor's fill depends on those values only, never on the data, so a
    kept one is the one Triton would fill."""

    __slots__ = ("kernel", "run", "head", "descriptors")

    def __init__(self, kernel: JITFunction, compiled) -> None:
        # Held so that the kernel's id, in this binary's key, is never reused by another kernel while
        # the key exists (a JITFunction made and dropped, as tests and benchmark copies do).
        self.kernel = kernel
        c_launch, descriptors = _c_launcher(compiled.run)
        self.descriptors = descriptors  # (position among the arguments, Triton's metadata), last first
        if c_launch is None:
            self.run = compiled.run
            self.head = (compiled.function, compiled.packed_metadata, None, None, None)
        else:  # what CudaLauncher.__call__ passes its C function: no scratch, no launch metadata, no hooks
            self.run = c_launch
            self.head = (compiled.function, compiled.run.launch_cooperative_grid, compiled.run.launch_pdl, None, None,
                         compiled.packed_metadata, None, None, None)  # fmt: skip

    def launch(self, grid: tuple[int, ...], stream: int, values) -> None:
        if self.descriptors:
            values = list(values)
            for position, metadata in self.descriptors:
                values[position : position + 1] = filled_descriptor(values[position], metadata)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        self.run(grid[0], grid_y, grid_z, stream, *self.head, *values)


def _c_launcher(run: object) -> tuple[object | None, tuple[tuple[int, object], ...]]:
    """(C launch function, ((argument position, descriptor metadata), ...) last first) behind
    Triton 3.6's `CudaLauncher` `run`, or (None, ()) for any other launcher or Triton version, or a
    kernel that needs scratch memory (those keep `run`)."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None, ()
    if (
        type(run) is not getattr(driver, "CudaLauncher", None)
        or getattr(driver, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO"  # 3.6's arguments ahead of the kernel's
        or run.global_scratch_size
        or run.profile_scratch_size
    ):
        return None, ()
    if isinstance(run.launch, types.BuiltinFunctionType):  # no descriptor: the C function itself
        return run.launch, ()
    captured = inspect.getclosurevars(run.launch).nonlocals  # 3.6's wrap_handle_tensordesc
    if set(captured) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        return None, ()
    positions = sorted(captured["tensordesc_indices"])
    metadata = captured["tensordesc_meta"] or [None] * len(positions)
    return captured["launcher"], tuple(reversed(list(zip(positions, metadata, strict=True))))


# (address, shape, strides, block, padding, id of Triton's metadata) -> the launcher's arguments
_filled: dict[tuple, tuple] = {}
_FILLED_MAX = 4096  # cleared when full: activations come and go at new addresses


def filled_descriptor(desc: TensorDescriptor, metadata: object) -> tuple:
    """Triton's arguments for descriptor `desc` of a kernel whose descriptor metadata is `metadata`
    (`make_tensordesc_arg`: the filled CUtensorMap, shape, strides), kept per the values that fill
    depends on. `metadata` is held by a `_Binary` for the process's life, so its id is stable.
    Without metadata (a kernel that did not lower the descriptor to TMA) the arguments hold the
    tensor itself: made afresh, never kept."""
    if metadata is None:
        return _fill(desc, None)
    key = (desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape), desc.padding,
           id(metadata))  # fmt: skip
    args = _filled.get(key)
    if args is None:
        if len(_filled) >= _FILLED_MAX:
            _filled.clear()
        args = _filled[key] = _fill(desc, metadata)
    return args


def _fill(desc: TensorDescriptor, metadata: object) -> tuple:
    """Triton's own fill of a descriptor's arguments (imported here: only a kept fill's miss needs it)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return tuple(make_tensordesc_arg(desc, metadata))


def _hooks_idle(kernel: JITFunction) -> bool:
    """No pre-run hook on kernel and no launch hook in Triton's knobs (asked at every launch)."""
    runtime = knobs.runtime
    return not kernel.pre_run_hooks and _calls_nothing(runtime.launch_enter_hook) and (
        _calls_nothing(runtime.launch_exit_hook))  # fmt: skip


def _calls_nothing(hook: object) -> bool:
    """A launch hook that calls nothing: none, or Triton's empty `HookChain` (3.6's default)."""
    return hook is None or not getattr(hook, "calls", True)


@contextlib.contextmanager
def through_triton() -> Iterator[None]:
    """Within: every `launch` takes Triton's own path (`kernel[grid]`), to compare host times
    (`mok bench host --cuda`) or to rule the direct launch out when chasing a problem."""
    global _direct
    saved, _direct = _direct, False
    try:
        yield
    finally:
        _direct = saved
