"""The benchmark's in-process jobs (HF peers, per-token costs) pinned as the stack's target
worker is: `bench.measure.job_env` gives the job's interpreter libgomp's OMP_PROC_BIND and one
place a thread, and a real torch interpreter started with it runs its main thread and its
OpenMP thread one CPU each (negative control: `off` leaves both free)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.measure import job_env

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")

PROBE = """
import json, os, torch
torch.ones(1 << 20).mul_(2.0)  # a parallel region: the pool exists
print(json.dumps(sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task"))))
"""


def thread_cpus(cpu_bind: str, cpus: set[int]) -> list[list[int]]:
    """Each OS thread's CPUs in a torch interpreter given the job's environment, run on `cpus`
    (as a machine with just these CPUs would run it)."""
    env = job_env({"threads": 2, "cpu_bind": cpu_bind})
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        timeout=120,
    )
    return json.loads(out.stdout)


def test_jobs_run_pinned_where_the_target_worker_would_be():
    # which CPUs is the worker's decision (bind_plan, tests/unit/test_worker_threads.py)
    a, b = sorted(os.sched_getaffinity(0))[:2]
    env = job_env({"threads": 2, "cpu_bind": f"{a},{b}"})
    assert env["OMP_PROC_BIND"] == "true" and env["OMP_PLACES"] == f"{{{a}}},{{{b}}}"
    assert "OMP_PROC_BIND" not in job_env({"threads": 2, "cpu_bind": "off"})
    pinned = thread_cpus(f"{a},{b}", {a, b})
    assert [a] in pinned and [b] in pinned  # the main thread and the pool's, one CPU each
    assert [a, b] not in pinned
    free = thread_cpus("off", {a, b})  # negative control
    assert all(cpus == [a, b] for cpus in free)
