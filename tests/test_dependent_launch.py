"""Programmatic dependent launch (`launch.DEPENDENT_LAUNCHES`, v39): the multi-kernel variant's kernels
launched so that their programs start while the kernel before them drains, each waiting for every
kernel before it (griddepcontrol.wait) before its first memory access. On the CPU: every kernel of the
variant waits first (its source), the wait precedes every global memory access of the compiled sm_90
code (the PTX, with and without TMA), and a fwd+bwd passes PDL to every launch when switched on and to
none when off. On a GPU (tests/test_gpu_layer.py): the same bits with and without, eager and replayed
from a CUDA graph."""

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton_cases import outside_the_interpreter  # noqa: E402

from mok_plugin.bench.host import experts_step, stubbed_launches  # noqa: E402
from mok_plugin.kernels import combine, grouped_mlp, schedule  # noqa: E402
from mok_plugin.kernels import launch as launch_module  # noqa: E402
from mok_plugin.testing import parse_shape  # noqa: E402

KERNEL_MODULES = [grouped_mlp, combine, schedule]  # every kernel they define goes through `launch`


def _kernels(module) -> list[ast.FunctionDef]:
    """The module's top-level functions named *_kernel (its kernels; device functions are named otherwise)."""
    tree = ast.parse(Path(inspect.getsourcefile(module)).read_text())
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")]


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_kernel_waits_for_the_kernels_before_it_first(module):
    # A kernel launched dependent reads and writes nothing before its wait, so it sees memory as in
    # stream order: its first statement (after the docstring) is the wait, and PDL is off by default.
    kernels = _kernels(module)
    assert kernels
    for node in kernels:
        last, default = node.args.args[-1], node.args.defaults[-1] if node.args.defaults else None
        assert last.arg == "PDL" and isinstance(default, ast.Constant) and default.value is False, node.name
        body = node.body[1:] if isinstance(node.body[0].value, ast.Constant) else node.body
        assert ast.unparse(body[0]) == "wait_for_prior_kernels(PDL)", f"{node.name} starts with {ast.unparse(body[0])}"


def test_the_wait_precedes_every_memory_access_in_the_compiled_kernels():
    # What the source promises must survive compilation: in the sm_90 PTX of the row GEMMs (pointer
    # loads and TMA) and the swept weight gradient, griddepcontrol.wait comes before the first global
    # load, store or asynchronous copy, and the kernels keep their shared memory. Compiled in a process
    # of its own: the tests run kernels interpreted.
    code = """
import json, re
from mok_plugin.bench.inspect import compile_for_hopper
from mok_plugin.kernels.configs import kernel_config
memory = re.compile(r"\\b(ld\\.global|st\\.global|cp\\.async|red\\.global|atom\\.global)")
found = {}
cases = [("down_fwd", "down_fwd"), ("gate_up_dgrad", "gate_up_dgrad"), ("wgrad_down", "wgrad_sweep_few_rows")]
for kernel, entry in cases:
    for pdl in (False, True):
        compiled = compile_for_hopper(kernel, kernel_config(entry, 4096), pdl=pdl)
        ptx = compiled.asm["ptx"]
        found[f"{kernel} {pdl}"] = [ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"),
                                    min(m.start() for m in memory.finditer(ptx)), compiled.metadata.shared]
print(json.dumps(found))
"""
    found = json.loads(outside_the_interpreter("-c", code, timeout=600).splitlines()[-1])
    for kernel in ("down_fwd", "gate_up_dgrad", "wgrad_down"):
        wait, dependents, first_access, shared = found[f"{kernel} True"]
        assert 0 <= wait < dependents < first_access, (kernel, found[f"{kernel} True"])
        assert found[f"{kernel} False"][:2] == [-1, -1] and found[f"{kernel} False"][3] == shared, found


@pytest.mark.parametrize("tokens", [1, 512], ids=["one_chunk_schedule", "chunked_schedule"])
def test_a_step_passes_pdl_to_every_launch_when_switched_on_and_to_none_when_off(tokens, monkeypatch):
    # On meta tensors, with the GPU's check stood in: the chunked schedule's three kernels at T = 512,
    # its one-kernel path at T = 1, the row GEMMs, the epilogue, combines and weight gradients.
    monkeypatch.setattr(launch_module, "dependent_launch_ok", lambda kernel: True)
    step = experts_step(parse_shape(f"{tokens},256,128,16,4"))
    for switched_on in (False, True):
        monkeypatch.setattr(launch_module, "DEPENDENT_LAUNCHES", switched_on)
        with stubbed_launches(calls := []):
            step()
        assert len(calls) >= 9, calls
        for name, kwargs in calls:
            expected = {"PDL": True, "launch_pdl": True} if switched_on else {}
            assert {key: kwargs[key] for key in ("PDL", "launch_pdl") if key in kwargs} == expected, name


def test_no_dependent_launch_off_a_hopper_gpu_or_under_torch_compile(monkeypatch):
    kernel = JITFunction(grouped_mlp._down_fwd_kernel.fn)  # compiled, whatever TRITON_INTERPRET says
    monkeypatch.setattr(launch_module, "_gpu_present", lambda: False)
    assert not launch_module.dependent_launch_ok(kernel)  # no GPU
    monkeypatch.setattr(launch_module, "_gpu_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_module, "_has_copy_engine", lambda device: False)
    assert not launch_module.dependent_launch_ok(kernel)  # before Hopper: no griddepcontrol
    monkeypatch.setattr(launch_module, "_has_copy_engine", lambda device: True)
    assert launch_module.dependent_launch_ok(kernel)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not launch_module.dependent_launch_ok(kernel)  # torch.compile's launcher takes no launch_pdl
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    interpreted = InterpretedFunction(grouped_mlp._down_fwd_kernel.fn)
    assert not launch_module.dependent_launch_ok(interpreted)  # the interpreter has no griddepcontrol
