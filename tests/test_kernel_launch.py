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


@pytest.fixture
def recorded(monkeypatch):
    """A fresh JITFunction of _scale_kernel whose Triton path (compile + launch) is recorded,
    bound by Triton's binder for sm_90, on "device 0" with "stream 7"."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = JITFunction(_scale_kernel.fn)  # compiled, whatever TRITON_INTERPRET says
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


def test_a_repeated_specialization_launches_the_cached_binary_with_every_argument(recorded):
    kernel, compiled, triton_path = recorded
    x, out = torch.randn(64), torch.empty(64)
    launch(kernel, (4,), x, out, 64, 2.0, BLOCK=16, num_warps=4)
    assert len(triton_path) == 1 and not compiled.launches  # compiled and launched by Triton
    launch(kernel, (4, 3), x, out, 64, 0.5, BLOCK=16, num_warps=4)  # floats are not specialised
    assert len(triton_path) == 1
    assert compiled.launches == [(4, 3, 1, 7, "function", "packed metadata", None, None, None, x, out, 64, 0.5, 16)]


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


def test_anything_but_a_jit_kernel_is_indexed_and_called():
    calls = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launch(StandIn(), (2, 1), 1, 2, BLOCK=3)
    assert calls == [((2, 1), (1, 2), {"BLOCK": 3})]
    assert launch_module._TRITON_GETITEM is JITFunction.__getitem__


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
