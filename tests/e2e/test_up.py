"""`specdec up` with the committed demo pair: ready banner, CLI and client greedy output equal
to the target's own `generate`, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.client import Client
from specdec.serving.redis_embedded import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECDEC = [sys.executable, "-m", "specdec"]
PROMPT = "import os\n\n\ndef read_config(path):\n"
N = 32


def descendants(pid: int) -> set[int]:
    """PIDs of every process below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def hf_greedy(prompt: str, n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(ROOT, "models", "target"), dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "target"))
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.slow
def test_specdec_up_serves_the_demo_pair_and_stops_cleanly():
    port = free_port()
    up = subprocess.Popen(
        [*SPECDEC, "up", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "specdec up exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("serving;"):
                break
        banner = "".join(lines)
        assert f"coordinator at 127.0.0.1:{port}" in banner and "specdec generate" in banner
        assert "demo completion" in banner and "mean acceptance length" in banner
        children = descendants(up.pid)
        assert len(children) >= 4  # redis-server, draft worker, target worker, coordinator

        expected = hf_greedy(PROMPT, N)
        cli = subprocess.run(
            [
                *SPECDEC,
                "generate",
                "--addr",
                f"127.0.0.1:{port}",
                "--max-new-tokens",
                str(N),
                "--ignore-eos",
                "--json",
                PROMPT,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        response = json.loads(cli.stdout)
        assert [int(t) for t in response["token_ids"]] == expected
        assert response["finish_reason"] == "FINISH_REASON_LENGTH"
        with Client(f"127.0.0.1:{port}") as client:
            for gamma in (None, 0, 4):
                result = client.generate(
                    PROMPT, max_new_tokens=N, ignore_eos=True, num_speculative_tokens=gamma
                )
                assert list(result.token_ids) == expected, gamma

        up.send_signal(signal.SIGINT)  # Ctrl-C
        up.wait(timeout=60)
        assert up.returncode == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "orphan processes after Ctrl-C"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_specdec_up_reports_a_failed_start(tmp_path):
    """The target worker cannot load its model: up names the part and why, and stops the rest."""
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    result = subprocess.run(
        [*SPECDEC, "up", "--port", str(free_port()), "--target-model", str(broken), "--no-demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1
    assert "start-up failed" in result.stderr and "target-worker-0" in result.stderr
    leftovers = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(broken).encode() in f.read() and alive(int(entry)):
                    leftovers.append(entry)
        except OSError:
            pass
    assert not leftovers, "processes left behind after a failed start"
    missing = subprocess.run(
        [*SPECDEC, "up", "--target-model", "/nonexistent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "--target-model /nonexistent" in missing.stderr
