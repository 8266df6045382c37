"""Runs a module as `python -m` would, with a probe thread that writes the process's threads.

    python tests/thread_probe.py TRIGGER_DIR MODULE [ARGS...]

Each time a file `N.go` appears in TRIGGER_DIR (N = 1, 2, ...), the probe writes `N.json`:
every OS thread of the process (`/proc/self/task`) with its name, CPU ticks and the CPUs it may
run on, and whether Python knows it as one of its threads. The file `N.go` may hold a command run first, on the
probe's own thread: `parallel` runs one torch op big enough for a parallel region (a negative
control: a thread that is not the model's starts an OpenMP pool).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time


def threads() -> list[dict]:
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    out = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpus = sorted(os.sched_getaffinity(int(tid)))
        except FileNotFoundError:  # exited meanwhile
            continue
        out.append(
            {
                "tid": int(tid),
                "name": name,
                "ticks": int(fields[11]) + int(fields[12]),
                "python": python_names.get(int(tid)),  # its Python name, or None
                "main": int(tid) == os.getpid(),
                "cpus": cpus,  # the CPUs it may run on
            }
        )
    return out


def probe(directory: str) -> None:
    n = 1
    while True:
        go = os.path.join(directory, f"{n}.go")
        if not os.path.exists(go):
            time.sleep(0.05)
            continue
        with open(go) as f:
            command = f.read().strip()
        if command == "parallel":
            import torch

            torch.ones(1 << 20).mul_(2.0)
        with open(os.path.join(directory, f"{n}.json.tmp"), "w") as f:
            json.dump(threads(), f)
        os.rename(os.path.join(directory, f"{n}.json.tmp"), os.path.join(directory, f"{n}.json"))
        n += 1


if __name__ == "__main__":
    trigger_dir, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    threading.Thread(target=probe, args=(trigger_dir,), name="thread-probe", daemon=True).start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
