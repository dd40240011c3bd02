"""What sets a pass's peak memory: the tensors live at the peak, by the line that allocated them.

Read from the CUDA caching allocator's trace (`torch.cuda.memory._record_memory_history`). Owns no
timing; `peak_live_set` works on any trace, so it is tested on a synthetic one without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["memory_breakdown", "peak_live_set", "print_memory"]

# Frames from files whose path holds one of these are "ours": a tensor is attributed to the first of them.
_OUR_PATHS = ("mok_plugin", "scripts")


def peak_live_set(trace: list[dict]) -> tuple[int, list[dict]]:
    """From one device's caching-allocator trace (`torch.cuda.memory._snapshot()["device_traces"]`):
    the most bytes live at once among the allocations the trace saw made, and those allocations,
    oldest first, each with the first frame of this project's code that made it ("site").

    Args:
        trace: allocator events in order ({"action", "addr", "size", "frames"}).
    Returns:
        (peak bytes, [{"bytes": int, "site": "file.py:line function"}]); "?" when no frame is known.
    """
    live: dict[int, dict] = {}
    current = best = 0
    best_live: list[dict] = []
    for event in trace:
        if event["action"] == "alloc":
            frames = event.get("frames") or []
            ours = [f for f in frames if any(part in f["filename"] for part in _OUR_PATHS)]
            frame = (ours or frames or [None])[0]
            site = f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}" if frame else "?"
            live[event["addr"]] = {"bytes": event["size"], "site": site}
            current += event["size"]
            if current > best:
                best, best_live = current, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["bytes"]
    return best, best_live


def memory_breakdown(work: Callable[[], object]) -> dict:
    """The tensors live at the peak of one call of `work` (torch.cuda.memory history; the inputs
    and anything allocated before the call are not counted): what sets the peak MiB column.

    Returns:
        {"peak_bytes": int, "live": peak_live_set's list}.
    """
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        work()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = peak_live_set(trace)
    return {"peak_bytes": peak, "live": live}


def print_memory(row: dict) -> None:
    """Print a layer-benchmark row's "memory" entry: tensors of at least 64 KiB, oldest first."""
    memory = row["memory"]
    print(f"\n{row['shape']} {row['routing']} {row['provider']}: tensors live at the peak of one forward + backward "
          f"({memory['peak_bytes'] / 2**20:.2f} MiB)")  # fmt: skip
    for tensor in memory["live"]:
        if tensor["bytes"] >= 2**16:
            print(f"  {tensor['bytes'] / 2**20:10.2f} MiB  {tensor['site']}")
