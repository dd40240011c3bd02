"""`launch.launch`: a Triton launch with less host work. On the CPU, with Triton's own binder (the
arguments specialised as for an sm_90 GPU) and the compile and launch recorded: which calls take
Triton's path and which launch a cached binary, with what. On a GPU: every fast launch gives the
bits of Triton's path, including arguments whose alignment or value changes the binary."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from mok_plugin.kernels import launch as launch_module  # noqa: E402
from mok_plugin.kernels.launch import launch, through_triton  # noqa: E402


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


class _Compiled:
    """Stands in for a CompiledKernel: records each direct launch."""

    function, packed_metadata = "function", "packed metadata"

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def run(self, *args) -> None:
        self.launches.append(args)


def _recorded(kernel: JITFunction, monkeypatch) -> tuple:
    """kernel with its Triton path (compile + launch) recorded, bound by Triton's binder for sm_90, on
    "device 0" with "stream 7": (kernel, the compiled stand-in, the Triton path's calls)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    kernel.device_caches = {0: (None, None, None, None, binder)}
    compiled, triton_path = _Compiled(), []

    def run(*args, grid, warmup, **kwargs):
        triton_path.append((grid, args, kwargs))
        return compiled

    kernel.run = run
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return kernel, compiled, triton_path


@pytest.fixture
def recorded(monkeypatch):
    """A fresh JITFunction of _scale_kernel, recorded (`_recorded`)."""
    return _recorded(JITFunction(_scale_kernel.fn), monkeypatch)  # compiled, whatever TRITON_INTERPRET says


def test_a_repeated_specialization_launches_the_cached_binary_with_every_argument(recorded):
    kernel, compiled, triton_path = recorded
    x, out = torch.randn(64), torch.empty(64)
    launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16, num_warps=4)
    assert len(triton_path) == 1 and not compiled.launches  # compiled and launched by Triton
    launch(kernel, (4, 3), x, out, 64, 0.5, BLOCK=16, num_warps=4)  # floats are not specialised
    assert len(triton_path) == 1
    assert compiled.launches == [(4, 3, 1, 7, "function", "packed metadata", None, None, None, x, out, 64, 0.5, 16)]


def test_a_dropped_kernels_id_never_picks_its_binary():
    """The binaries are keyed by the kernel's id: each one holds its kernel, so no kernel made later
    (tests and benchmarks make and drop JITFunctions) can take that id and launch the wrong binary."""
    import gc
    import weakref

    kernel = JITFunction(_scale_kernel.fn)
    kernel.device_caches = {0: (None, None, None, None, lambda *args, **kwargs: ({}, (), {}))}
    kernel.run = lambda *args, grid, warmup, **kwargs: _Compiled()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: 0)
        launch(kernel, (1,))
    dropped = weakref.ref(kernel)
    del kernel
    JITFunction(_scale_kernel.fn)  # Triton 3.8 keeps the latest JITFunction of a name: not the dropped one
    gc.collect()
    assert dropped() is not None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda x, out: ((x[1:], out[1:], 63, 2.0), {"BLOCK": 16, "num_warps": 4}), id="misaligned"),
        pytest.param(lambda x, out: ((x, out, 1, 2.0), {"BLOCK": 16, "num_warps": 4}), id="n_is_one"),
        pytest.param(lambda x, out: ((x, out, 60, 2.0), {"BLOCK": 16, "num_warps": 4}), id="n_not_16"),
        pytest.param(lambda x, out: ((x, out, 64, 2.0), {"BLOCK": 32, "num_warps": 4}), id="constexpr"),
        pytest.param(lambda x, out: ((x, out, 64, 2.0), {"BLOCK": 16, "num_warps": 8}), id="num_warps"),
        pytest.param(lambda x, out: ((x.half(), out, 64, 2.0), {"BLOCK": 16, "num_warps": 4}), id="dtype"),
    ],
)
def test_another_specialization_goes_through_triton(recorded, change):
    kernel, compiled, triton_path = recorded
    x, out = torch.randn(64), torch.empty(64)
    launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16, num_warps=4)
    args, kwargs = change(x, out)
    launch(kernel, (4,), *args, **kwargs)
    assert len(triton_path) == 2 and not compiled.launches
    launch(kernel, (4,), *args, **kwargs)  # now cached too
    assert len(triton_path) == 2 and len(compiled.launches) == 1


def test_hooks_compiling_and_stand_ins_keep_tritons_path(recorded, monkeypatch):
    kernel, compiled, triton_path = recorded
    x, out = torch.randn(64), torch.empty(64)
    for _ in range(2):
        launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)
    assert (len(triton_path), len(compiled.launches)) == (1, 1)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)  # a profiler's launch hook sees every launch
    try:
        launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    kernel.add_pre_run_hook(hook)
    launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)
    kernel.pre_run_hooks.clear()
    assert (len(triton_path), len(compiled.launches)) == (3, 1)

    with through_triton():
        launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)
    launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)  # direct again after it
    assert (len(triton_path), len(compiled.launches)) == (4, 2)
    with monkeypatch.context() as patch:  # torch.compile traces kernel[grid] (and cannot trace the direct path)
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)
    assert (len(triton_path), len(compiled.launches)) == (5, 2)

    counted = []  # `mok bench host` counts launches by replacing JITFunction.__getitem__
    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: lambda *a, **k: counted.append(grid))
    launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16)
    assert counted == [(4,)] and (len(triton_path), len(compiled.launches)) == (5, 2)


def test_gluon_kernels_launch_directly_keyed_by_their_descriptors_layouts(monkeypatch):
    """A `gluon.jit` kernel (rows_hopper's) takes the direct path as a `triton.jit` one does; a
    descriptor of another block, and so another shared layout, picks another binary."""
    from mok_plugin.kernels import rows_hopper, wgrad_hopper

    if rows_hopper.gluon is None:
        pytest.skip("needs Triton's Gluon")
    kernel, constexprs, plan = rows_hopper.kernel_arguments(torch.bfloat16, "cooperative", True, False, False)
    kernel, compiled, triton_path = _recorded(type(kernel)(kernel.fn), monkeypatch)
    rows, weights = torch.randn(256, 128).bfloat16(), torch.randn(2 * 256, 128).bfloat16()
    out, tile_to_expert = torch.empty(1, 256, 256, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64)

    def launch_rows(block_n: int) -> None:
        blocks = ((rows, (128, 64)), (weights, (block_n, 64)), (out, (1, 128, block_n)))
        descriptors = [wgrad_hopper.gluon_descriptor(t, block) for t, block in blocks]
        launch(kernel, (2,), *descriptors, tile_to_expert, (out, 0, out, out), 256, 256, 128, 128, 4,
               num_warps=plan.num_warps, **constexprs)  # fmt: skip

    launch_rows(plan.block_n)
    launch_rows(plan.block_n)
    assert (len(triton_path), len(compiled.launches)) == (1, 1)
    assert compiled.launches[0][:9] == (2, 1, 1, 7, "function", "packed metadata", None, None, None)
    launch_rows(plan.block_n // 2)
    assert (len(triton_path), len(compiled.launches)) == (2, 1)


def test_anything_but_a_jit_kernel_is_indexed_and_called():
    calls = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launch(StandIn(), (2, 1), 1, 2, BLOCK=3)
    assert calls == [((2, 1), (1, 2), {"BLOCK": 3})]
    assert launch_module._TRITON_GETITEM is JITFunction.__getitem__


class _Descriptor:
    """Stands in for a TensorDescriptor (what `filled_descriptor` reads of one)."""

    def __init__(self, base, block_shape) -> None:
        self.base, self.shape, self.strides = base, base.shape, base.stride()
        self.block_shape, self.padding = block_shape, "zero"


@pytest.fixture
def fills(monkeypatch):
    """Triton's descriptor fill replaced by one that records what it filled."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    made = []

    def make_tensordesc_arg(desc, metadata):
        made.append((desc.base.data_ptr(), tuple(desc.block_shape), metadata))
        return [f"map {len(made)}", *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", make_tensordesc_arg)
    monkeypatch.setattr(launch_module, "_filled", {})
    return made


def test_a_descriptor_is_filled_once_per_address_shape_and_block(fills):
    weights, other = torch.randn(4, 64), torch.randn(4, 64)
    meta = {"swizzle": 128}
    first = launch_module.filled_descriptor(_Descriptor(weights, [2, 32]), meta)
    assert first == ("map 1", 4, 64, 64, 1)
    assert launch_module.filled_descriptor(_Descriptor(weights, [2, 32]), meta) == first  # kept
    launch_module.filled_descriptor(_Descriptor(other, [2, 32]), meta)  # another address
    launch_module.filled_descriptor(_Descriptor(weights, [4, 32]), meta)  # another block
    launch_module.filled_descriptor(_Descriptor(weights[:2], [2, 32]), meta)  # another shape
    launch_module.filled_descriptor(_Descriptor(weights, [2, 32]), {"swizzle": 64})  # another kernel's layout
    assert len(fills) == 5
    for _ in range(2):  # no metadata: the arguments hold the tensor, so never kept
        launch_module.filled_descriptor(_Descriptor(weights, [2, 32]), None)
    assert len(fills) == 7 and len(launch_module._filled) == 5


def test_the_kept_fills_are_bounded(fills, monkeypatch):
    monkeypatch.setattr(launch_module, "_FILLED_MAX", 3)
    base = torch.randn(16, 64)
    for row in range(5):
        launch_module.filled_descriptor(_Descriptor(base[row : row + 1], [1, 32]), {})
    assert len(fills) == 5 and len(launch_module._filled) <= 3


def test_tritons_cuda_launcher_is_unwrapped_to_its_c_function(fills, monkeypatch):
    """With Triton 3.6's CudaLauncher (its descriptor wrapper imitated), a launch calls the C
    function with the scratch, metadata and hook slots empty and each descriptor expanded."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    calls = []

    def c_launch(*args):
        calls.append(args)

    def wrap(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):  # 3.6's wrap_handle_tensordesc keeps these three names
            return launcher, tensordesc_indices, tensordesc_meta

        return inner

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self, launch) -> None:
            self.launch = launch

    monkeypatch.setattr(driver, "CudaLauncher", CudaLauncher, raising=False)
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)
    compiled = _Compiled()
    metas = [{"swizzle": 128}, {"swizzle": 64}]
    compiled.run = CudaLauncher(wrap(c_launch, {1, 3}, metas))
    a, b = torch.randn(4, 64), torch.randn(8, 32)
    binary = launch_module._Binary(_scale_kernel, compiled)
    binary.launch((5,), 7, ("x", _Descriptor(a, [2, 32]), 3, _Descriptor(b, [4, 32])))
    assert calls == [
        (5, 1, 1, 7, "function", False, True, None, None, "packed metadata", None, None, None,
         "x", "map 2", 4, 64, 64, 1, 3, "map 1", 8, 32, 32, 1),
    ]  # fmt: skip
    assert fills == [(b.data_ptr(), (4, 32), metas[1]), (a.data_ptr(), (2, 32), metas[0])]

    compiled.run = CudaLauncher(len)  # a kernel without descriptors: the C function itself
    assert launch_module._Binary(_scale_kernel, compiled).run is len
    compiled.run.global_scratch_size = 256  # scratch memory: Triton's launcher allocates it
    assert launch_module._Binary(_scale_kernel, compiled).run is compiled.run
    compiled.run = CudaLauncher(len)
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "another version's", raising=False)
    assert launch_module._Binary(_scale_kernel, compiled).run is compiled.run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_fast_launches_give_tritons_bits():
    kernel = JITFunction(_scale_kernel.fn)  # compiled, whatever TRITON_INTERPRET says
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, device="cuda", generator=generator)
    cases = [(x, 1000, 1.5), (x[1:], 999, 1.5), (x[3:], 997, -0.25), (x, 1, 3.0), (x[:960], 960, 0.5)]
    for _ in range(3):  # first Triton's path (compile), then the cached binaries
        for src, n, factor in cases:
            out = torch.full((n,), float("nan"), device="cuda")
            launch(kernel, (triton.cdiv(n, 128),), src, out, n, factor, BLOCK=128)
            assert torch.equal(out, src[:n] * factor)
            unaligned = torch.full((n + 1,), float("nan"), device="cuda")[1:]  # out's start not 16-byte aligned
            launch(kernel, (triton.cdiv(n, 128),), src, unaligned, n, factor, BLOCK=128)
            assert torch.equal(unaligned, src[:n] * factor)


@triton.jit
def _double_block_kernel(src, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = 2 * src, src read through a TMA descriptor a [BLOCK_M, BLOCK_N] block a program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    block = src.load([tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N])
    tl.store(out_ptr + rows * N + cols, block * 2, mask=(rows < M) & (cols < N))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a GPU with TMA (Hopper)"
)
def test_on_the_gpu_kept_descriptors_read_the_tensor_at_hand():
    """Kept descriptor fills: tensors at other addresses, of other shapes, and a new tensor at a freed
    one's address are each read as they are, as Triton's own launch reads them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = JITFunction(_double_block_kernel.fn)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def doubled(src: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(src, float("nan"))
        grid = (triton.cdiv(src.shape[0], 32), triton.cdiv(src.shape[1], 64))
        launch(kernel, grid, TensorDescriptor.from_tensor(src, [32, 64]), out, *src.shape, BLOCK_M=32, BLOCK_N=64)
        return out

    a = torch.randn(96, 128, device="cuda", generator=generator)
    b = torch.randn(100, 192, device="cuda", generator=generator)
    for _ in range(3):  # Triton's path first, then direct launches with kept fills
        for src in (a, b, a[:40], a):
            assert torch.equal(doubled(src), src * 2)
        address = b.data_ptr()
        del b
        b = torch.randn(100, 192, device="cuda", generator=generator)  # likely the freed address, new values
        assert torch.equal(doubled(b), b * 2), f"same address: {b.data_ptr() == address}"
    with through_triton():
        assert torch.equal(doubled(a), a * 2)
    binaries = [binary for key, binary in launch_module._binaries.items() if key[0] == id(kernel)]
    assert binaries
    if triton.__version__.startswith("3.6"):  # the C launcher with kept fills, not Triton's Python
        assert all(binary.descriptors and binary.run.__class__.__name__ == "builtin_function_or_method"
                   for binary in binaries)  # fmt: skip
