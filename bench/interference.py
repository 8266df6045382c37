"""How much CPU other processes took while a measurement ran (Linux /proc).

Timings on a shared 2-core machine mean little when something else runs. `CpuWatch` takes the
machine's busy CPU time from /proc/stat and subtracts this process tree's own (this process,
its reaped children, and its live descendants: the stack's workers, coordinator and Redis),
so what is left is the share of the machine that other processes used during the window.
"""

from __future__ import annotations

import os
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / TICK


def _stats() -> dict[int, tuple[int, float]]:
    """pid → (ppid, utime+stime+cutime+cstime in seconds) of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        out[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK)
    return out


def _tree_s(root: int) -> float:
    stats = _stats()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += children.get(pid, [])
    return total


class CpuWatch:
    """Start with `CpuWatch()`; `others()` = share of all cores used by other processes since."""

    def __init__(self) -> None:
        self.available = os.path.exists("/proc/stat")
        self.start = time.monotonic()
        if self.available:
            self.busy0, self.tree0 = _busy_s(), _tree_s(os.getpid())

    def others(self) -> float | None:
        if not self.available:
            return None
        wall = time.monotonic() - self.start
        busy, tree = _busy_s() - self.busy0, _tree_s(os.getpid()) - self.tree0
        cores = os.cpu_count() or 1
        return max(0.0, busy - tree) / (wall * cores) if wall > 0 else 0.0
