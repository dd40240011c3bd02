"""The GPU's SM clock and power draw, sampled in the background while a benchmark runs and tagged with
what was running (an A/B's side), so that a side that reads slower because it ran at a lower clock can
be told from one that does more work. Hopper holds its power cap by lowering the clock, and comes
down to it over seconds of work after a pause: in session 51's null A/B on an H100 (B the same code)
B's kernels read 7-19 % slower, B's side at 1388-1404 MHz against A's 1592-1614 (BENCHMARKS.md,
"The A/B's clock").

Read through `nvidia-smi` in a thread (one query every `period_s`), not NVML bindings, which the
device's Python does not carry; where nvidia-smi is absent nothing is sampled.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = [
    "ClockLog",
    "Reading",
    "clock_log",
    "describe",
    "gpu_selector",
    "nvidia_smi_reader",
    "summary_of",
    "running",
    "tagged",
]

Reading = tuple[float, float]  # (SM clock in MHz, power draw in W)


def gpu_selector(device: int | None = None) -> str:
    """nvidia-smi's `-i` for a CUDA device: its PCI bus id where torch gives one (CUDA's device order
    need not be nvidia-smi's), else the CUDA ordinal."""
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    if all(hasattr(props, name) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return str(index)


def nvidia_smi_reader(gpu: str) -> Callable[[], Reading | None] | None:
    """A function reading one GPU's SM clock and power draw (None for a failed query), or None where
    nvidia-smi is not installed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    command = [exe, "-i", gpu, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]

    def read() -> Reading | None:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=5, check=True).stdout
            mhz, watts = (float(value) for value in out.strip().splitlines()[0].split(","))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None  # a busy or odd query: a sample fewer, never a failed benchmark
        return mhz, watts

    return read


class ClockLog:
    """Samples `read()` every `period_s` while `running()`, keeping each sample under the label set
    by `side(label)` at both ends of its query (samples taken while no side runs, or across a change
    of side, are dropped)."""

    def __init__(self, read: Callable[[], Reading | None], period_s: float = 0.25) -> None:
        self._read = read
        self._period_s = period_s
        self._label: str | None = None
        self._samples: dict[str, list[Reading]] = {}
        self._stop = threading.Event()
        self.failed_reads = 0  # queries that gave no reading (running() says so if none gave one)

    @contextlib.contextmanager
    def running(self) -> Iterator[ClockLog]:
        """Samples in a thread while the block runs; afterwards says on stderr if no query answered
        (the reports then have no clock lines, which should not pass for "not asked")."""
        self._stop.clear()
        thread = threading.Thread(target=self._sample, name="mok-clock-log", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=self._period_s + 10)  # a query hung in the driver must not hold the report
            if self.failed_reads and not self._samples:
                message = f"nvidia-smi answered none of {self.failed_reads} queries; no SM clock is reported"
                print(f"clock log: {message}", file=sys.stderr)

    @contextlib.contextmanager
    def side(self, label: str) -> Iterator[None]:
        self._label = label
        try:
            yield
        finally:
            self._label = None

    def _sample(self) -> None:
        while not self._stop.wait(self._period_s):
            label = self._label
            if label is None:
                continue
            reading = self._read()
            self.failed_reads += reading is None
            if reading is not None and self._label == label:
                self._samples.setdefault(label, []).append(reading)

    def summary(self, group: Callable[[str], str] | None = None) -> dict[str, dict]:
        """{label: {"sm_mhz": mean, "watts": mean, "samples": count}} for each label sampled; with
        `group`, the samples of every label under group(label) together (a side's profiles)."""
        taken: dict[str, list[Reading]] = {}
        for label, readings in list(self._samples.items()):  # the thread may add
            taken.setdefault(group(label) if group else label, []).extend(list(readings))
        return {
            label: {"sm_mhz": statistics.fmean(r[0] for r in readings),
                    "watts": statistics.fmean(r[1] for r in readings), "samples": len(readings)}
            for label, readings in taken.items()
        }  # fmt: skip


def clock_log(enabled: bool = True) -> ClockLog | None:
    """A ClockLog of the current CUDA device through nvidia-smi, or None when not `enabled` or where
    nvidia-smi is absent; start it with `running()`."""
    if not enabled:
        return None
    read = nvidia_smi_reader(gpu_selector())
    if read is None:
        print("clock log: no nvidia-smi on this machine; no SM clock is reported", file=sys.stderr)
        return None
    return ClockLog(read)


def running(clock: ClockLog | None) -> contextlib.AbstractContextManager:
    """`clock.running()`, or nothing without a clock log."""
    return clock.running() if clock else contextlib.nullcontext()


def tagged(clock: ClockLog | None, label: str) -> contextlib.AbstractContextManager:
    """`clock.side(label)`, or nothing without a clock log."""
    return clock.side(label) if clock else contextlib.nullcontext()


def summary_of(clock: ClockLog | None, label: str) -> dict | None:
    """`label`'s entry of `clock.summary()`, or None (no clock log, or no sample under it)."""
    return clock.summary().get(label) if clock else None


def describe(entry: dict | None) -> str:
    """One label's summary as a report prints it ("1404 MHz 686 W (20 samples)"); "" for none."""
    if not entry:
        return ""
    return f"{entry['sm_mhz']:.0f} MHz {entry['watts']:.0f} W ({entry['samples']} samples)"
