"""`--linear-kernel`, `--batch-attention`, `--attention-kernel` and `--model-forward` on a real
worker process:
auto runs a float32 CPU model's linears on the compiled streamed kernel and says so, `packed` on
oneDNN; `packed` or `compiled` on a model that cannot run them (bfloat16) refuses to start,
naming the flag. Auto attends over each session's own KV where the
model qualifies (also in bfloat16) and says so, short blocks by the compiled kernel in float32,
keeps the padded batch where it does not qualify and says why; `sessions` on such a model, and
`--attention-kernel compiled` in bfloat16, refuse to start, naming the flag. Auto runs the
lean forward where attention reads the sessions' own KV, `hf` does not, and `lean` over the
padded batch refuses to start, naming the flag."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_worker(model_dir: str, *flags: str, timeout_s: float = 120.0) -> tuple[int | None, str]:
    """Start a target worker; return (exit code or None if it came up, its log so far)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env["OMP_NUM_THREADS"] = "1"
    args = ["--model", model_dir, "--host", "127.0.0.1", "--port", "0", *flags]
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


@pytest.fixture(scope="module")
def default_worker(model_dirs) -> tuple[int | None, str]:
    """A float32 CPU worker with the defaults (auto kernels, auto attention), started once."""
    return run_worker(model_dirs["target"], "--device", "cpu")


def test_auto_packs_a_float32_model_on_the_cpu(default_worker):
    code, log = default_worker
    assert code is None, log
    assert "linear layers on the compiled streamed kernel" in log


def test_packed_runs_onednn(model_dirs):
    code, log = run_worker(model_dirs["target"], "--device", "cpu", "--linear-kernel", "packed")
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
    code, log = run_worker(
        model_dirs["target"],
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--linear-kernel",
        "compiled",
    )
    assert code not in (None, 0), log
    assert "linear_kernel: compiled needs a float32 model on a CPU" in log
    assert "Traceback" not in log


def test_auto_attends_over_each_sessions_own_kv(model_dirs, default_worker):
    code, log = default_worker
    assert code is None, log
    assert "batched attention over each session's own KV" in log
    code, log = run_worker(model_dirs["target"], "--device", "cpu", "--dtype", "bfloat16")
    assert code is None, log
    assert "batched attention over each session's own KV" in log


def test_auto_attends_short_blocks_with_the_compiled_kernel(model_dirs, default_worker):
    """float32 on a CPU: the compiled kernel (built by `make`); bfloat16: torch's attention;
    `--attention-kernel compiled` where it cannot attend refuses to start, naming the flag."""
    code, log = default_worker
    assert code is None, log
    assert "short blocks by the compiled kernel" in log
    code, log = run_worker(model_dirs["target"], "--device", "cpu", "--attention-kernel", "torch")
    assert code is None, log
    assert "batched attention over each session's own KV" in log
    assert "compiled kernel" not in log
    code, log = run_worker(
        model_dirs["target"], "--device", "cpu", "--dtype", "bfloat16",
        "--attention-kernel", "compiled",
    )  # fmt: skip
    assert code not in (None, 0), log
    assert "attention_kernel: compiled needs float32 attention" in log
    assert "Traceback" not in log


def test_auto_runs_the_lean_forward_and_hf_the_models_own(model_dirs, default_worker):
    code, log = default_worker
    assert code is None, log
    assert "; the lean forward" in log
    code, log = run_worker(model_dirs["target"], "--device", "cpu", "--model-forward", "hf")
    assert code is None, log
    assert "batched attention over each session's own KV" in log
    assert "lean forward" not in log
    code, log = run_worker(
        model_dirs["target"], "--device", "cpu", "--batch-attention", "padded",
        "--model-forward", "lean",
    )  # fmt: skip
    assert code not in (None, 0), log
    assert "model_forward: lean does not fit this model" in log
    assert "Traceback" not in log


def test_padded_keeps_the_batch_copy(model_dirs):
    code, log = run_worker(model_dirs["target"], "--device", "cpu", "--batch-attention", "padded")
    assert code is None, log
    assert "batched attention over a padded batch copy" in log


def test_a_model_that_does_not_qualify_keeps_the_padded_batch(model_dirs, tmp_path):
    """A config that asks for sliding-window attention, which per-session attention does not
    mask: auto says why it keeps the padded batch; sessions refuses to start."""
    windowed = tmp_path / "windowed"
    shutil.copytree(model_dirs["target"], windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    code, log = run_worker(str(windowed), "--device", "cpu")
    assert code is None, log
    assert "batched attention over a padded batch copy: sliding-window attention" in log
    code, log = run_worker(str(windowed), "--device", "cpu", "--batch-attention", "sessions")
    assert code not in (None, 0), log
    assert "batch_attention: sessions does not fit this model: sliding-window attention" in log
    assert "Traceback" not in log
