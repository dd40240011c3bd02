"""Where the FP8 Gluon weight gradients' cycles go, inside the kernel: `mok bench wgrad-rows --profile`.

Proton (Triton's profiler) can record a clock at each scope's entry and exit, per warp, in kernels
whose source holds `triton.profiler.language` scopes, when its instrumentation backend is on. The
kernels hold none (they would compile to nothing, but crowd the code): `scoped_copy` writes the
package into a directory of its own with the scopes of SCOPES inserted, and the profile runs there,
in a process of its own, one launch a case. A kernel edit that moves an anchor makes `scoped_copy`
fail by name (tests/test_bench_kernel_scopes.py checks the anchors and that the copy compiles).

The trace converts clock64 cycles at Proton's default 1,000 MHz, so its microseconds are kilocycles.
`per_tile` reads them per warp: an MMA warp's scopes summed over its tiles (each ends in "epilogue"),
a loader warp's over its K steps; "period" is the time from one mark to the next. Found with it
(BENCHMARKS.md, f14-f15): the two MMA warpgroups run each K step in step, so neither hides the
other's promotion; the pipelined steps came of that.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

__all__ = ["SCOPES", "per_tile", "profile", "scoped_copy"]

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
        (  # the scales' loads issued (their latency shows where they are used: the promotion)
            "        rows_ptrs, rows_ok = scales[0], scales[1]\n",
            '        pl.enter_scope("scales")\n        rows_ptrs, rows_ok = scales[0], scales[1]\n',
        ),
        (
            "other=0.0))\n        return values\n",
            'other=0.0))\n        pl.exit_scope("scales")\n        return values\n',
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
            "            m_half = m0 + WHICH * HALF\n",
            '            pl.enter_scope("tile_setup")\n'
            "            expert, m0, n0, steps, first_row = tile_work(t, work, M, N, BM, BN, BK, ROWS)\n"
            "            m_half = m0 + WHICH * HALF\n",
        ),
        (
            "            scales = tile_scales(acc, expert, m_half, n0, first_row, work, M, N, ROWS)\n"
            "            acc, products = ",
            "            scales = tile_scales(acc, expert, m_half, n0, first_row, work, M, N, ROWS)\n"
            '            pl.exit_scope("tile_setup")\n'
            "            acc, products = ",
        ),
        (
            "            finish_half(out_desc, c_smem, acc, expert, m_half, n0, epilogue, M, N, ROWS, BIAS, ROUTING)\n",
            '            with pl.scope("epilogue"):\n'
            "                finish_half(out_desc, c_smem, acc, expert, m_half, n0, epilogue, M, N, ROWS, BIAS, "
            "ROUTING)\n",
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


def scoped_copy(dest: Path) -> Path:
    """The package copied to dest/mok_plugin with SCOPES inserted; dest (to run from). A ValueError
    names the file and anchor that is not in the source exactly once."""
    shutil.copytree(PACKAGE, dest / "mok_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    for name, edits in SCOPES.items():
        path = dest / "mok_plugin" / name
        text = path.read_text()
        for anchor, scoped in edits:
            if text.count(anchor) != 1:
                raise ValueError(f"{name}: found {text.count(anchor)} times, expected once: {anchor.strip()!r}")
            text = text.replace(anchor, scoped)
        if text.count(IMPORT) != 1:
            raise ValueError(f"{name}: no single {IMPORT.strip()!r} block to import Proton's scopes in")
        path.write_text(text.replace(IMPORT, IMPORT + "    import triton.profiler.language as pl\n"))
    return dest


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


def _operands(m: int, n: int, rows: int, experts: int):
    """A call of the FP8 weight gradients on random operands, `rows` rows for each of `experts`."""
    import torch

    from mok_plugin.kernels import fp8_mlp

    total = rows * experts
    g = torch.Generator(device="cuda").manual_seed(0)
    left = (torch.randn(m, total, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    right = (torch.randn(n, total, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    left_s = torch.rand(total // 128, m, device="cuda", generator=g) + 0.5
    right_s = torch.rand(total // 128, n, device="cuda", generator=g) + 0.5
    offsets = torch.arange(experts + 1, device="cuda", dtype=torch.int64) * rows
    counts = torch.full((experts,), rows, device="cuda", dtype=torch.int64)
    return lambda: fp8_mlp.fp8_wgrad(left, left_s, right, right_s, offsets, counts, out_dtype=torch.bfloat16)


def _run_here(m: int, n: int, total: int, rows_per_expert: list[int], out: Path) -> dict:
    """In the scoped copy's process: one traced launch a case, each trace read then deleted (~100 MB)."""
    import torch
    import triton.profiler as proton

    results = {}
    for rows in rows_per_expert:
        call = _operands(m, n, rows, total // rows)
        call()  # compiled without the scopes' records, so the traced launch below compiles its own
        torch.cuda.synchronize()
        name = out / f"wgrad_{rows}"
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


def profile(m: int, n: int, total: int, rows_per_expert: list[int], out: Path) -> dict:
    """{rows an expert: per_tile's table} of the FP8 weight gradients (M, N; `total` rows split evenly),
    measured in a scoped copy of the package, in a process of its own."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mok-scopes-") as tmp:
        root = scoped_copy(Path(tmp))
        code = (
            "import json, sys; from pathlib import Path; from mok_plugin.bench import kernel_scopes as k; "
            f"print(json.dumps(k._run_here({m}, {n}, {total}, {rows_per_expert!r}, Path({str(out.resolve())!r}))))"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the scoped profile failed:\n{run.stderr[-3000:]}")
    return {int(rows): table for rows, table in json.loads(run.stdout.strip().splitlines()[-1]).items()}
