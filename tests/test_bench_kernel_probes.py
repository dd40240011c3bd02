"""`mok bench wgrad-rows --profile` and `--ablate`: their parts that need no GPU. The modified copies of
the kernels (every anchor still in the source; the copies compile for sm_90), the reading of Proton's
trace, and the arguments."""

import pytest
import torch
from triton_cases import outside_the_interpreter

from mok_plugin.bench import kernel_probes, wgrad_rows


@pytest.mark.parametrize("edits", ["scopes", *kernel_probes.ABLATIONS, "all ablations"])
def test_every_edit_finds_its_anchor_in_the_kernels_as_they_are(tmp_path, edits):
    if edits == "scopes":
        edits = kernel_probes.SCOPES
    else:
        edits = kernel_probes.merged(list(kernel_probes.ABLATIONS) if edits == "all ablations" else [edits])
    root = kernel_probes.modified_copy(tmp_path, edits)
    for name, changes in edits.items():
        text = (root / "mok_plugin" / name).read_text()
        assert ("    import triton.profiler.language as pl\n" in text) == (edits is kernel_probes.SCOPES)
        for _, changed in changes:
            assert changed in text
    # the package itself is untouched
    assert "pl.scope" not in (kernel_probes.PACKAGE / "kernels" / "fp8_hopper.py").read_text()


def test_an_anchor_the_kernels_lost_is_named(tmp_path):
    with pytest.raises(ValueError, match="kernels/fp8_hopper.py: found 0 times.*no such line"):
        kernel_probes.modified_copy(tmp_path, {"kernels/fp8_hopper.py": [("no such line\n", "x")]})


def test_an_unknown_ablation_is_named():
    with pytest.raises(ValueError, match="unknown ablation 'epilogue'"):
        kernel_probes.merged(["promote", "epilogue"])


@pytest.mark.parametrize("edits", ["scopes", "all ablations"])
def test_the_modified_kernels_compile_for_sm90(tmp_path, edits):
    # the scopes compile to nothing without Proton's instrumentation: this checks that each copy is Gluon
    # that compiles, and that the copy, not the package, is what its process imports
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon")
    edits = kernel_probes.SCOPES if edits == "scopes" else kernel_probes.merged(list(kernel_probes.ABLATIONS))
    root = kernel_probes.modified_copy(tmp_path, edits)
    code = (
        "import torch, mok_plugin\n"
        "from mok_plugin.bench.inspect import compile_fp8_hopper\n"
        "compile_fp8_hopper('wgrad', torch.bfloat16)\n"
        "compile_fp8_hopper('rows', torch.bfloat16, bias=True, routing=True)\n"
        "print(mok_plugin.__file__)\n"
    )
    assert outside_the_interpreter("-c", code, timeout=600, cwd=root).strip().startswith(str(root))


def _event(name, ts, dur, cta, warp, line=0):
    """A Proton trace's complete event, as its chrome trace names CTAs and warps."""
    tid = f"warp {warp} (line {line})"
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": f"kernel CTA{cta}", "tid": tid}


def test_per_tile_sums_each_warps_scopes_over_its_tiles_and_averages_the_warps():
    events = [{"ph": "M", "name": "metadata"}]
    for cta in range(2):
        t = 0.0
        for _ in range(4):  # an MMA warp: 3 steps of promote 0.2 + cta * 0.1, then an epilogue; 2.0 a tile
            for _ in range(3):
                events.append(_event("promote", t, 0.2 + 0.1 * cta, cta, 0))
                t += 0.5
            events.append(_event("epilogue", t, 0.3, cta, 0, line=0))
            events.append(_event("store_wait", t + 0.1, 0.05, cta, 0, line=1))  # nested: another line
            t += 0.5
        for step in range(6):  # the loader: a wait of 0.4 each step, 1.0 apart
            events.append(_event("load_wait_empty", float(step), 0.4, cta, 8))
    table = kernel_probes.per_tile(events)
    assert table["mma"]["period"] == pytest.approx(2.0)
    assert table["mma"]["promote"] == pytest.approx(3 * 0.25)  # the two CTAs' warps: 0.6 and 0.9 a tile
    assert table["mma"]["epilogue"] == pytest.approx(0.3) and table["mma"]["store_wait"] == pytest.approx(0.05)
    assert table["loader"] == pytest.approx({"period": 1.0, "load_wait_empty": 0.4})


def test_ablations_are_named_from_the_table_and_exclude_the_profile(capsys):
    parser = wgrad_rows.build_parser()
    assert parser.parse_args(["--ablate", "promote", "stores"]).ablate == ["promote", "stores"]
    for argv in (["--ablate", "epilogue"], ["--profile", "--ablate", "promote"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    err = capsys.readouterr().err
    assert "invalid choice: 'epilogue'" in err and "not allowed with argument --profile" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
@pytest.mark.parametrize("probe", [["--profile"], ["--ablate", "promote"]])
def test_a_probe_without_a_gpu_says_so_and_returns_2(capsys, probe):
    assert wgrad_rows.main([*probe, "--rows-per-expert", "256"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_probe_runs_in_its_own_process_on_the_modified_copy():
    # the machinery the GPU probes go through: a temporary copy with the edits, a process that imports it
    found = kernel_probes._in_copy(kernel_probes.merged(["promote"]), "[k.__file__, k.PACKAGE.name]")
    assert "mok-probe-" in found[0] and found[1] == "mok_plugin"
    with pytest.raises(RuntimeError, match="the probe failed in its copy"):
        kernel_probes._in_copy({}, "k.no_such_name")
