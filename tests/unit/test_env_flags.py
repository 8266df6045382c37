"""SPECDEC_* variables are read as the command line is: converted with the flag's type and
checked against its choices or pattern, refused with the flag named before any work starts
(argparse checks choices on the command line only; a variable becomes a default) — in
every service and in `specdec up`."""

import argparse
import os
import subprocess
import sys

import pytest

from draft_worker.__main__ import DraftSettings
from specdec.serving.settings import add_flags, from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv: list[str]) -> DraftSettings:
    parser = argparse.ArgumentParser()
    add_flags(parser, DraftSettings)
    return from_args(DraftSettings, parser.parse_args(argv))


def test_variables_are_converted_like_flags(monkeypatch):
    monkeypatch.setenv("SPECDEC_THREADS", "3")
    monkeypatch.setenv("SPECDEC_PROPOSER", "ngram")
    monkeypatch.setenv("SPECDEC_LOG_LEVEL", "debug")
    monkeypatch.setenv("SPECDEC_MAX_WAIT_MS", "2.5")
    settings = parse([])
    assert (settings.threads, settings.proposer, settings.log_level) == (3, "ngram", "debug")
    assert settings.max_wait_ms == 2.5
    assert parse(["--threads", "5"]).threads == 5  # the command line wins


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "SPECDEC_PROPOSER",
            "bogus",
            "argument --proposer: expected one of model | ngram, got 'bogus' (from SPECDEC_PROPOSER)",
        ),
        ("SPECDEC_LOG_LEVEL", "warn", "argument --log-level: expected one of debug | info"),
        ("SPECDEC_DTYPE", "fp8", "argument --dtype: expected one of auto | float32"),
        (
            "SPECDEC_THREADS",
            "abc",
            "argument --threads: invalid int value: 'abc' (from SPECDEC_THREADS)",
        ),
        ("SPECDEC_REFLECTION", "maybe", "SPECDEC_REFLECTION: expected true or false"),
    ],
)
def test_a_bad_variable_is_refused_naming_it(monkeypatch, capsys, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        parse([])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--proposer", "bogus"], ["--log-level", "verbose"]])
def test_the_same_values_are_refused_on_the_command_line(capsys, flag):
    with pytest.raises(SystemExit):
        parse(flag)
    assert f"argument {flag[0]}: expected one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True)]
    + [("0", False), ("false", False), ("No", False), ("off", False), ("", False)],
)
def test_boolean_variables(monkeypatch, value, expected):
    monkeypatch.setenv("SPECDEC_REFLECTION", value)
    assert parse([]).reflection is expected


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SPECDEC_PORT", "abc", "argument --port: invalid int value: 'abc'"),
        ("SPECDEC_LOG_LEVEL", "warn", "argument --log-level: expected one of debug | info"),
        ("SPECDEC_PROPOSER", "x", "argument --proposer: expected one of model | ngram, got 'x'"),
        ("SPECDEC_TLS", "maybe", "SPECDEC_TLS: expected true or false"),
    ],
)
def test_specdec_up_refuses_a_bad_variable_before_starting(variable, value, message):
    env = {**os.environ, "PYTHONPATH": ROOT, variable: value}
    argv = [sys.executable, "-m", "specdec", "up", "--no-demo"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode in (1, 2), done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr and "READY" not in done.stdout
