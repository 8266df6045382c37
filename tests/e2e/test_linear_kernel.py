"""`--linear-kernel` on a real worker process: auto packs a float32 CPU model and says so;
`packed` on a model that cannot run packed (bfloat16) refuses to start, naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdec.serving.redis_embedded import free_port

pytestmark = pytest.mark.slow


def run_worker(model_dir: str, *flags: str, timeout_s: float = 120.0) -> tuple[int | None, str]:
    """Start a target worker; return (exit code or None if it came up, its log so far)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env["OMP_NUM_THREADS"] = "1"
    args = ["--model", model_dir, "--host", "127.0.0.1", "--port", str(free_port()), *flags]
    proc = subprocess.Popen(
        [sys.executable, "-m", "target_worker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        for line in proc.stdout:  # until it is warm or it exits
            lines.append(line)
            if "worker warm" in line:
                return None, "".join(lines)
        return proc.wait(timeout=timeout_s), "".join(lines)
    finally:
        proc.kill()
        proc.wait()


def test_auto_packs_a_float32_model_on_the_cpu(model_dirs):
    code, log = run_worker(model_dirs["target"], "--device", "cpu")
    assert code is None, log
    assert "linear layers on prepacked oneDNN kernels" in log


def test_default_keeps_torchs_kernels(model_dirs):
    code, log = run_worker(model_dirs["target"], "--device", "cpu", "--linear-kernel", "default")
    assert code is None, log
    assert "torch's own linear kernels" in log


def test_packed_on_a_model_it_cannot_pack_refuses_to_start(model_dirs):
    code, log = run_worker(
        model_dirs["target"], "--device", "cpu", "--dtype", "bfloat16", "--linear-kernel", "packed"
    )
    assert code not in (None, 0), log
    assert "linear_kernel: packed needs a float32 model" in log
    assert "Traceback" not in log
