"""The machine a run measured: CPU model and cores, torch, threads, the load, the GPU.

The load average is ``os.getloadavg()`` (what ``uptime`` prints), read before the first
measurement and after the last. A 1-minute load above the core count means other processes
wanted the cores the run timed on: its ratios are then unreliable (a parallel region waits for
a descheduled thread; rounds are disturbed unevenly), and :func:`load_warning` says so.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["cpu_model", "describe", "load_average", "load_warning", "oversubscribed_note"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> tuple[float, float, float] | None:
    """The 1-, 5- and 15-minute load averages, or None where the OS has none."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def load_warning(load: tuple[float, float, float] | None, n_cores: int) -> str | None:
    """A warning when the 1-minute load exceeds the core count, else None."""
    if load is None or load[0] <= n_cores:
        return None
    return (
        f"WARNING: the 1-minute load average ({load[0]:.2f}) exceeds the {n_cores} cores: other processes "
        "share the machine, the figures are unreliable. Re-run when `uptime` shows a load below the core count."
    )


def oversubscribed_note(load: tuple[float, float, float] | None, n_cores: int, threads: int) -> str | None:
    """A note when the load plus the run's own threads exceed the cores (short of :func:`load_warning`).

    Then a parallel region of the run waits for a thread the OS gave to another process: with 2
    threads on 2 cores and one busy process, a small op can take a scheduler time slice."""
    if load is None or load[0] > n_cores or load[0] + threads <= n_cores + 0.5:
        return None
    return (
        f"NOTE: the load ({load[0]:.2f}) plus this run's {threads} threads exceed the {n_cores} cores: "
        "parallel regions may wait for descheduled threads (wide spreads). A quieter machine, or --threads 1, helps."
    )


def describe(threads: int, devices: list[str]) -> dict[str, Any]:
    """The machine, as plain data (the report's header and the JSON's ``machine``)."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": threads,
        "load_before": load_average(),
    }
    if "cuda" in devices and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
        info["cuda"] = torch.version.cuda
    return info
