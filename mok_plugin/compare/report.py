"""The comparison's outputs: a printed table, JSON, a Markdown report and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["format_table", "write_reports"]


def format_table(result: dict) -> str:
    s, b = result["summary"], result["bitwise"]
    lines = [
        f"{'variant':<8} {'step ms':>9} {'tokens/s':>10} {'peak MiB':>9} {'final loss':>11}  two runs bitwise equal",
    ]
    for variant in ("stock", "mok"):
        r = s[variant]
        lines.append(f"{variant:<8} {r['step_ms']:>9.2f} {r['tokens_per_s']:>10.0f} {r['peak_memory_mib']:>9.0f} "
                     f"{r['final_loss']:>11.5f}  {'yes' if b[variant] else 'NO'}")  # fmt: skip
    ratio = s["mok"]["tokens_per_s"] / s["stock"]["tokens_per_s"]
    lines.append(f"MoK / stock tokens/s: {ratio:.2f}x")
    return "\n".join(lines)


def _markdown(result: dict) -> str:
    meta = result["meta"]
    out = [f"# MoK vs stock: {meta['config']}", "",
           f"- framework: {meta['framework']}; device: {meta['device']}; steps: {meta['steps']}; "
           f"tokens per step: {meta['tokens_per_step']}",
           f"- model: {meta['model']}", f"- what ran: {meta['mode']}", "",
           "| variant | step ms | tokens/s | peak memory (MiB) | final loss | two runs bitwise equal |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for variant in ("stock", "mok"):
        r = result["summary"][variant]
        out.append(f"| {variant} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_memory_mib']:.0f} | "
                   f"{r['final_loss']:.5f} | {'yes' if result['bitwise'][variant] else 'no'} |")  # fmt: skip
    out += ["", f"Peak memory: {meta['memory_kind']}.", "", "## Loss at each step", "",
            "| step | " + " | ".join(f"{r['variant']} #{r['repeat']}" for r in result["runs"]) + " |",
            "|---" * (len(result["runs"]) + 1) + "|"]  # fmt: skip
    for i in range(meta["steps"]):
        out.append(f"| {i + 1} | " + " | ".join(f"{r['losses'][i]:.6f}" for r in result["runs"]) + " |")
    out += ["", "Plot: `comparison.png` (loss per step; tokens/s).", ""]
    return "\n".join(out)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for r in result["runs"]:
        ax_loss.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", markersize=3,
                     linestyle="-" if r["repeat"] == 1 else "--", label=f"{r['variant']} #{r['repeat']}")  # fmt: skip
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    variants = ["stock", "mok"]
    ax_speed.bar(variants, [result["summary"][v]["tokens_per_s"] for v in variants], color=["tab:gray", "tab:blue"])
    ax_speed.set(ylabel="tokens/s", title="throughput (median of two runs)")
    fig.suptitle(f"{result['meta']['config']} ({result['meta']['framework']}, {result['meta']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(result: dict, out_dir: Path) -> dict[str, Path]:
    """comparison.json, comparison.md and comparison.png in out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "comparison.json", "markdown": out_dir / "comparison.md",
             "plot": out_dir / "comparison.png"}  # fmt: skip
    paths["json"].write_text(json.dumps(result, indent=2))
    paths["markdown"].write_text(_markdown(result))
    _plot(result, paths["plot"])
    return paths
