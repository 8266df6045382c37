"""--device is checked when the flags are read (a worker's, and bench.run's, which is the
same field): a value torch would only refuse after the model loads is refused at once,
naming the flag, from the command line and from SPECDEC_DEVICE alike."""

import argparse
import os
import subprocess
import sys

import pytest

from specdec.serving.settings import add_flags
from specdec.worker.settings import WorkerSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerSettings, only=("device",))
    return parser.parse_args(argv)


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:1"])
def test_devices_torch_names_pass(value):
    assert parse(["--device", value]).device == value


@pytest.mark.parametrize("value", ["tpu", "cuda:", "cuda:x", "cpu ", ""])
def test_other_devices_are_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse(["--device", value])
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_worker_process_refuses_a_bad_device_before_loading(how, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = [sys.executable, "-m", "target_worker", "--model", str(tmp_path / "absent")]
    if how == "flag":
        argv += ["--device", "tpu"]
    else:
        env["SPECDEC_DEVICE"] = "tpu"
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "argument --device: expected auto | cpu | cuda[:N], got 'tpu'" in done.stderr
