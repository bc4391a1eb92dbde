"""CPU time from /proc, shared by the benchmarks (and tests) that report who
used the cores."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process C{pid}."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wake_ups(pid: int) -> tuple[int, int]:
    """The context switches of process C{pid}, all its threads together:
    voluntary (a thread blocked and had to be woken again: each one a wait
    for a core on a busy machine) and involuntary (preempted)."""
    voluntary = involuntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        for line in lines:
            name, _, value = line.partition(":")
            if name == "voluntary_ctxt_switches":
                voluntary += int(value)
            elif name == "nonvoluntary_ctxt_switches":
                involuntary += int(value)
    return voluntary, involuntary


def machine_busy_seconds() -> float:
    """Busy CPU time of the whole machine (all cores) since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class OutsideLoad:
    """
    Cores' worth of CPU used by processes other than C{pids} (and this one)
    during a measurement, in C{cores}: on a shared machine, a number that says
    how far to trust the measurement. 0 where there is no /proc.
    """

    def __init__(self, pids):
        self._pids = {os.getpid(), *pids}
        self._available = os.path.exists("/proc/stat")
        self.cores = 0.0

    def _ours(self) -> float:
        total = 0.0
        for pid in self._pids:
            try:
                total += cpu_seconds(pid)
            except FileNotFoundError:  # it exited meanwhile
                pass
        return total

    def _sample(self):
        return time.perf_counter(), machine_busy_seconds(), self._ours()

    def __enter__(self):
        if self._available:
            self._start = self._sample()
        return self

    def __exit__(self, *exc):
        if self._available:
            (t0, busy0, ours0), (t1, busy1, ours1) = self._start, self._sample()
            self.cores = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)
