"""bench/gpu_check.sh in its CPU smoke mode, and the negative controls of its greedy check."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
import torch

from bench.gpu_greedy import compare, perturb, verdict_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")


def run_script(out, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    environment.update({"OUT": str(out), "GPU_CHECK_DEVICE": "cpu", **env})
    process = subprocess.Popen(
        ["bash", SCRIPT, *args],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, _ = process.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)  # the driver stops its stack on SIGINT
        stdout, _ = process.communicate(timeout=60)
        pytest.fail(f"gpu_check.sh timed out:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, "")


def status_line(stdout: str, step: str) -> str:
    """The last PASS/FAIL/SKIP line of a step (the summary repeats it)."""
    lines = [ln for ln in stdout.splitlines() if re.match(rf"^(PASS|FAIL|SKIP)\s+{step}\s", ln)]
    assert lines, f"no status line for {step}:\n{stdout[-4000:]}"
    return lines[-1]


# --- the comparison itself, on fixed logits -----------------------------------------------


def fake_logits(peak: int, runner_up: int, gap: float, vocab: int = 16):
    logits = torch.zeros(vocab)
    logits[peak], logits[runner_up] = 10.0, 10.0 - gap
    return lambda _prefix: logits


def test_identical_outputs_pass():
    entry = compare([1, 2, 3], [1, 2, 3], fake_logits(2, 5, 3.0), tol=1e-3)
    assert entry["verdict"] == "identical" and verdict_ok([entry])


def test_a_difference_at_a_near_tie_is_tolerated_and_one_beyond_it_is_not():
    near = compare([1, 2, 3], [1, 5, 3], fake_logits(2, 5, 1e-4), tol=1e-3)
    assert near["verdict"] == "near-tie" and near["first_difference"] == 1
    assert verdict_ok([near])
    far = compare([1, 2, 3], [1, 5, 3], fake_logits(2, 5, 2.0), tol=1e-3)
    assert far["verdict"] == "differs" and far["gap"] == pytest.approx(2.0)
    assert not verdict_ok([near, far])
    strict = compare([1, 2, 3], [1, 5, 3], fake_logits(2, 5, 1e-4), tol=0.0)
    assert strict["verdict"] == "differs"


def test_a_shorter_output_differs():
    entry = compare([1, 2, 3], [1, 2], fake_logits(2, 5, 3.0), tol=1e-3)
    assert entry["verdict"] == "differs" and entry["first_difference"] == 2
    assert not verdict_ok([]), "no comparison at all must not pass"


def test_the_perturbed_reference_is_caught():
    """perturb() puts the least likely token in the middle: the true output now differs there."""

    class Judge:
        def logits(self, _prompt, _prefix):
            return torch.arange(16, dtype=torch.float32)  # token 0 least likely, 15 most

    reference = [15, 15, 15, 15]
    (perturbed,) = perturb([reference], [[7]], Judge())
    assert perturbed == [15, 15, 0, 15]
    entry = compare(perturbed, reference, lambda _p: torch.arange(16.0), tol=1e-3)
    assert entry["verdict"] == "differs" and entry["first_difference"] == 2


# --- the script, end to end on the CPU -----------------------------------------------------


def test_smoke_mode_passes_on_cpu(tmp_path):
    proc = run_script(tmp_path, "--smoke")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert "python " in out and "torch: " in out and "CUDA available: " in out
    assert status_line(out, "0-env").startswith("PASS")
    greedy = status_line(out, "1-greedy-float32")
    assert greedy.startswith("PASS") and "identical to HF" in greedy, greedy
    assert "reported as differing (as required)" in out  # the built-in negative control
    math = status_line(out, "2-math-cpu")
    assert math.startswith("PASS") and "bench.math cases (cpu): 4" in math, math
    assert status_line(out, "3-bench-run").startswith("SKIP")
    assert re.search(r"^gpu_check: 3 passed, 0 failed, 1 skipped", out, re.M), out[-2000:]
    assert (tmp_path / "greedy-cpu-float32.json").is_file()
    assert (
        (tmp_path / "summary.txt")
        .read_text()
        .strip()
        .splitlines()[-1]
        .startswith("gpu_check: 3 passed, 0 failed")
    )


def test_greedy_check_fails_against_a_perturbed_reference(tmp_path):
    """The negative control: with the reference perturbed, the same run must report FAIL."""
    proc = run_script(tmp_path, "--smoke", "--only=greedy", GPU_CHECK_PERTURB_REFERENCE="1")
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:]
    assert "NEGATIVE CONTROL" in out
    greedy = status_line(out, "1-greedy-float32")
    assert greedy.startswith("FAIL") and "negative control" in greedy, greedy
    assert re.search(r"^  γ=\d prompt \d: differs at token \d+, logit gap", out, re.M)
    assert re.search(r"^gpu_check: 1 passed, 1 failed", out, re.M), out[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_exits_2(tmp_path):
    proc = run_script(tmp_path, "--only=env", GPU_CHECK_DEVICE="cuda")
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "has no CUDA" in proc.stdout
    assert re.search(r"^gpu_check: 0 passed, 1 failed", proc.stdout, re.M), proc.stdout[-2000:]
