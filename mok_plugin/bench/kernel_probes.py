"""Probes of the FP8 Gluon weight gradients in modified copies of the package: where their cycles go
(`mok bench wgrad-rows --profile`) and what a part of each K step costs (`--ablate`).

The kernels stay as they are: `modified_copy` writes the package into a directory of its own with
edits at anchors in the kernels' source, and the probe runs there, in a process of its own. A kernel
edit that moves an anchor makes `modified_copy` fail by name (tests/test_bench_kernel_probes.py checks
every anchor, and that the modified copies compile for sm_90).

- SCOPES: Proton's (Triton's profiler) intra-kernel scopes around each part of a step. With its
  instrumentation backend on, each scope's entry and exit records a clock per warp; one launch a case.
  The trace converts clock64 cycles at Proton's default 1,000 MHz, so its microseconds are kilocycles.
  `per_tile` reads them per warp: an MMA warp's scopes summed over its tiles (each ends in
  "epilogue"), a loader warp's over its K steps; "period" is the time from one mark to the next.
  Found with it (BENCHMARKS.md, f14-f15): the two MMA warpgroups run each K step in step, so neither
  hides the other's promotion; the pipelined steps came of that.
- ABLATIONS: the kernel without a part (the promotion's scaling, the scales' reads from the stage, their
  copies into it, dW's stores), timed as the layer's benches time: an upper bound on what making that
  part free would give. The results are wrong by design; only the times mean anything.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

__all__ = ["ABLATIONS", "SCOPES", "ablated_times", "merged", "modified_copy", "per_tile", "profile"]

PACKAGE = Path(__file__).resolve().parents[1]
IMPORT = "if gluon is not None:\n"  # each scoped module's Gluon block, where `pl` is imported

# file (under the package) -> (anchor, the same lines with the scopes); each anchor must occur once
SCOPES: dict[str, list[tuple[str, str]]] = {
    "kernels/fp8_hopper.py": [
        (
            "        mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)\n        return warpgroup_mma(",
            '        with pl.scope("wait_ready"):\n'
            "            mbarrier.wait(ready.index(idx), ((c + s) // S) & 1)\n"
            '        pl.enter_scope("mma_issue")\n'
            "        token = warpgroup_mma(",
        ),
        (
            "                             registers, use_acc=False, is_async=True)  # fmt: skip\n",
            "                             registers, use_acc=False, is_async=True)  # fmt: skip\n"
            '        pl.exit_scope("mma_issue")\n'
            "        return token\n",
        ),
        (  # the step's scales read from its stage, the stage freed
            "        if not ROWS:\n            values = (stage_scales[0]",
            '        pl.enter_scope("scales")\n        if not ROWS:\n            values = (stage_scales[0]',
        ),
        (
            "        mbarrier.arrive(empty.index(idx), count=1)\n        return values\n",
            "        mbarrier.arrive(empty.index(idx), count=1)\n"
            '        pl.exit_scope("scales")\n'
            "        return values\n",
        ),
        (
            "            odd_done = warpgroup_mma_wait(1, deps=[odd])  # step s - 1's (at q = 0: nothing to wait "
            "for)\n",
            '            pl.enter_scope("mma_wait")\n'
            "            odd_done = warpgroup_mma_wait(1, deps=[odd])\n"
            '            pl.exit_scope("mma_wait")\n',
        ),
        (
            "            even = warpgroup_mma_wait(1, deps=[even_mma])  # step s's\n",
            '            pl.enter_scope("mma_wait")\n'
            "            even = warpgroup_mma_wait(1, deps=[even_mma])\n"
            '            pl.exit_scope("mma_wait")\n',
        ),
        (
            "        if ROWS:\n            acc += partial * values[:, None]\n",
            '        pl.enter_scope("promote")\n        if ROWS:\n            acc += partial * values[:, None]\n',
        ),
        (
            "            acc += partial * l_scale[:, None] * r_scale[None, :]\n        return acc\n",
            "            acc += partial * l_scale[:, None] * r_scale[None, :]\n"
            '        pl.exit_scope("promote")\n'
            "        return acc\n",
        ),
        (
            "            expert, m0, n0, steps, first_row = tile_work(t, work, M, N, BM, BN, BK, ROWS)\n"
            "            acc = gl.zeros(",
            '            pl.enter_scope("tile_setup")\n'
            "            expert, m0, n0, steps, first_row = tile_work(t, work, M, N, BM, BN, BK, ROWS)\n"
            "            acc = gl.zeros(",
        ),
        (
            "            scales = tile_scales(acc, expert, m0 + WHICH * HALF, n0, first_row, work, M, N, ROWS)\n",
            "            scales = tile_scales(acc, expert, m0 + WHICH * HALF, n0, first_row, work, M, N, ROWS)\n"
            '            pl.exit_scope("tile_setup")\n',
        ),
        (
            "            finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, epilogue, M, N, ROWS, BIAS, "
            "ROUTING)\n",
            '            with pl.scope("epilogue"):\n'
            "                finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, epilogue, M, N, ROWS, "
            "BIAS, ROUTING)\n",
        ),
        (  # the flat loop's (fp8_hopper.promote_step): a tile's store, then the next tile's work
            "        if g == last:\n"
            "            finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, (), M, N, False, False, "
            "False)\n",
            "        if g == last:\n"
            '            with pl.scope("epilogue"):\n'
            "                finish_half(out_desc, c_smem, acc, expert, m0 + WHICH * HALF, n0, (), M, N, False, False, "
            "False)\n",
        ),
        (
            "            t, expert, m0, n0, steps = nonempty_tile(t + gl.num_programs(0), acc, out_desc, c_smem, work, "
            "M, N,\n"
            "                                                     num_tiles, BK, WHICH)  # fmt: skip\n",
            '            pl.enter_scope("tile_setup")\n'
            "            t, expert, m0, n0, steps = nonempty_tile(t + gl.num_programs(0), acc, out_desc, c_smem, work, "
            "M, N,\n"
            "                                                     num_tiles, BK, WHICH)\n"
            '            pl.exit_scope("tile_setup")\n',
        ),
        (
            "                mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)  # first round passes at once\n",
            '                with pl.scope("load_wait_empty"):\n'
            "                    mbarrier.wait(empty.index(idx), ((p // S) & 1) ^ 1)\n",
        ),
    ],
    "kernels/wgrad_hopper.py": [
        (
            "        tma.store_wait(0)\n        c_smem.store(acc.to(out_desc.dtype))\n",
            '        with pl.scope("store_wait"):\n'
            "            tma.store_wait(0)\n"
            '        with pl.scope("smem_write"):\n'
            "            c_smem.store(acc.to(out_desc.dtype))\n",
        ),
    ],
}

# name -> the edits that take that part out (same form as SCOPES)
ABLATIONS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "promote": {  # acc += the product, unscaled: the FMULs and FFMAs, and the scales' reads, go
        "kernels/fp8_hopper.py": [
            ("            acc += partial * values[:, None]\n", "            acc += partial\n"),
            ("            acc += partial * l_scale[:, None] * r_scale[None, :]\n", "            acc += partial\n"),
        ],
    },
    "scales": {  # every step's scales zeros, not read from its stage (still brought there)
        "kernels/fp8_hopper.py": [
            (
                "            values = (stage_scales[0].index(idx).slice(WHICH * HALF, HALF).load(gl.SliceLayout(1, "
                "layout)),\n"
                "                      stage_scales[1].index(idx).load(gl.SliceLayout(0, layout)))  # fmt: skip\n",
                "            values = (gl.full([HALF], 0.0, gl.float32, gl.SliceLayout(1, layout)),\n"
                "                      gl.full([stage_scales[1].shape[1]], 0.0, gl.float32, "
                "gl.SliceLayout(0, layout)))\n",
            ),
        ],
    },
    "scale_copies": {  # the stages' scales not brought: their two TMA copies a step, and their bytes, go
        "kernels/fp8_hopper.py": [
            ("        SCALES: gl.constexpr = 1 - ROWS", "        SCALES: gl.constexpr = 0"),
            (
                "                    block = row // BK\n"
                "                    tma.async_copy_global_to_shared(a_descs[1], [block, m0], ready.index(idx), "
                "bufs[2].index(idx))\n"
                "                    tma.async_copy_global_to_shared(b_descs[1], [block, n0], ready.index(idx), "
                "bufs[3].index(idx))\n",
                "",
            ),
        ],
    },
    "stores": {  # dW not written (acc kept live by a condition never true, so nothing before it goes)
        "kernels/fp8_hopper.py": [
            (
                "            store_tile(out_desc, c_smem, acc, expert, m0, n0)  # out_desc: dW [E, M, N], clipped at "
                "each M\n",
                "            if expert < 0:\n                store_tile(out_desc, c_smem, acc, expert, m0, n0)\n",
            ),
        ],
    },
}


def modified_copy(dest: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """The package copied to dest/mok_plugin with `edits` (SCOPES, or ABLATIONS' entries merged) made;
    dest (to run from). A ValueError names the file and anchor not in the source exactly once."""
    shutil.copytree(PACKAGE, dest / "mok_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    for name, changes in edits.items():
        path = dest / "mok_plugin" / name
        text = path.read_text()
        for anchor, changed in changes:
            if text.count(anchor) != 1:
                raise ValueError(f"{name}: found {text.count(anchor)} times, expected once: {anchor.strip()!r}")
            text = text.replace(anchor, changed)
        if any("pl." in changed for _, changed in changes):  # Proton's scopes: imported in the Gluon block
            if text.count(IMPORT) != 1:
                raise ValueError(f"{name}: no single {IMPORT.strip()!r} block to import Proton's scopes in")
            text = text.replace(IMPORT, IMPORT + "    import triton.profiler.language as pl\n")
        path.write_text(text)
    return dest


def merged(names: list[str]) -> dict[str, list[tuple[str, str]]]:
    """ABLATIONS' edits of `names` together; a ValueError names an unknown one."""
    edits: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name in names:
        if name not in ABLATIONS:
            raise ValueError(f"unknown ablation {name!r}: expected one of {', '.join(ABLATIONS)}")
        for path, changes in ABLATIONS[name].items():
            edits[path] += changes
    return dict(edits)


def _role(names: set[str]) -> tuple[str, str] | None:
    """(role, the scope that ends each unit of work) of a warp that recorded `names`."""
    if "load_wait_empty" in names:
        return "loader", "load_wait_empty"
    if "epilogue" in names:
        return "mma", "epilogue"
    return None  # the epilogue's own warps' lines (store_wait, smem_write) are counted with the MMA warp's


def per_tile(events: list[dict]) -> dict[str, dict[str, float]]:
    """{role: {scope: kilocycles a unit, ..., "period": kilocycles between units}}, each the mean over
    the warps of that role: a unit is a tile for the MMA warps, a K step for the loader. Proton names
    a warp "warp W (line L)" (L: the nesting depth), so a warp's events are those of its W."""
    warps: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X":
            warp = re.search(r"warp (\d+)", str(event["tid"]))
            warps[(event["pid"], int(warp.group(1)) if warp else event["tid"])].append(event)
    found: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for warp_events in warps.values():
        role = _role({event["name"] for event in warp_events})
        if role is None:
            continue
        marks = sorted(event["ts"] for event in warp_events if event["name"] == role[1])
        if len(marks) < 2:
            continue
        start, end, units = marks[0], marks[-1], len(marks) - 1
        sums: dict[str, float] = defaultdict(float)
        for event in warp_events:
            if start <= event["ts"] < end:
                sums[event["name"]] += event["dur"]
        found[role[0]]["period"].append((end - start) / units)
        for name, total in sums.items():
            found[role[0]][name].append(total / units)
    return {role: {name: statistics.mean(values) for name, values in scopes.items()} for role, scopes in found.items()}


def _trace_here(m: int, n: int, total: int, rows_per_expert: list[int], out: str) -> dict:
    """In the scoped copy's process: one traced launch a case, each trace read then deleted (~100 MB)."""
    import torch
    import triton.profiler as proton

    from mok_plugin.bench.wgrad_rows import fp8_wgrad_call

    results = {}
    for rows in rows_per_expert:
        call = fp8_wgrad_call(m, n, total, rows)
        call()  # compiled without the scopes' records, so the traced launch below compiles its own
        torch.cuda.synchronize()
        name = Path(out) / f"wgrad_{rows}"
        # global: the kernel leaves no shared memory for Proton's buffer; circular: the last records a warp
        proton.start(str(name), data="trace", backend="instrumentation", mode=proton.mode.Default(buffer_type="global"))
        call()
        torch.cuda.synchronize()
        proton.finalize()
        trace = name.with_suffix(".chrome_trace")
        data = json.loads(trace.read_text())
        trace.unlink()
        results[rows] = per_tile(data["traceEvents"] if isinstance(data, dict) else data)
    return results


def _time_here(m: int, n: int, total: int, rows_per_expert: list[int], iters: int, settle_s: float) -> dict:
    """In a modified copy's process: {rows an expert: median ms}, timed as wgrad_rows times."""
    from mok_plugin.bench.timing import time_ms
    from mok_plugin.bench.wgrad_rows import fp8_wgrad_call

    return {rows: statistics.median(time_ms(fp8_wgrad_call(m, n, total, rows), iters, settle_s=settle_s))
            for rows in rows_per_expert}  # fmt: skip


def _in_copy(edits: dict[str, list[tuple[str, str]]], call: str):
    """The JSON that `call` (an expression over this module, `k`) returns, run in a modified copy."""
    with tempfile.TemporaryDirectory(prefix="mok-probe-") as tmp:
        root = modified_copy(Path(tmp), edits)
        code = f"import json; from mok_plugin.bench import kernel_probes as k; print(json.dumps({call}))"
        # run from the copy: `python -c` puts its working directory first on the path
        run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the probe failed in its copy:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def profile(m: int, n: int, total: int, rows_per_expert: list[int], out: Path) -> dict:
    """{rows an expert: per_tile's table} of the FP8 weight gradients (M, N; `total` rows split evenly),
    from one launch a case of a scoped copy of the package."""
    out.mkdir(parents=True, exist_ok=True)
    found = _in_copy(SCOPES, f"k._trace_here({m}, {n}, {total}, {rows_per_expert!r}, {str(out.resolve())!r})")
    return {int(rows): table for rows, table in found.items()}


def ablated_times(m: int, n: int, total: int, rows_per_expert: list[int], ablations: list[str], iters: int,
                  settle_s: float) -> dict[str, dict[int, float]]:  # fmt: skip
    """{variant: {rows an expert: ms}}: the kernel as it is (in a copy of its own too, so that both
    compile alike), without each ablation, and without all of them where several are named."""
    variants = {"as it is": []} | {f"without {name}": [name] for name in ablations}
    if len(ablations) > 1:
        variants["without " + " + ".join(ablations)] = list(ablations)
    call = f"k._time_here({m}, {n}, {total}, {rows_per_expert!r}, {iters}, {settle_s})"
    return {label: {int(rows): ms for rows, ms in _in_copy(merged(names), call).items()}
            for label, names in variants.items()}  # fmt: skip
