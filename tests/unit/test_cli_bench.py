"""`specdec bench X` runs bench X's own module for every bench subcommand the CLI lists (the
README documents each), not the full benchmark's."""

from __future__ import annotations

import importlib

import pytest

from specdec.launcher import cli

SUBCOMMANDS = sorted(name.split(" ", 1)[1] for name in cli.SERVICES if name.startswith("bench "))


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_each_bench_subcommand_reaches_its_module(sub, monkeypatch):
    called = []
    real = importlib.import_module

    def spy(name, *args):
        called.append(name)
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", spy)
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", sub, "--help"])
    assert done.value.code == 0
    assert called[0] == cli.SERVICES[f"bench {sub}"]  # (it may import more itself)


def test_the_spy_sees_the_full_benchmark_for_plain_bench(monkeypatch):
    """Negative control: `specdec bench --help` is the full benchmark's module, so the spy
    above tells the two apart."""
    called = []
    real = importlib.import_module
    monkeypatch.setattr(
        cli.importlib, "import_module", lambda name, *a: called.append(name) or real(name, *a)
    )
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert called[0] == "bench.run"
    assert len(SUBCOMMANDS) >= 10


def test_bench_split_reads_its_splits_and_names_a_bad_one():
    from bench.split import main, parse_split

    assert parse_split("2+1:off") == (2, 1, "off", "auto")
    assert parse_split("1+1:auto") == (1, 1, "auto", "auto")
    assert parse_split("2+1:off:off") == (2, 1, "off", "off")  # the target's --cpu-bind
    for bad in ("2+1", "2:off", "0+1:off", "2+1:maybe", "a+1:on", "2+1:off:0-1", "2+1:off:"):
        with pytest.raises(ValueError, match="--splits"):
            parse_split(bad)
    with pytest.raises(SystemExit) as done:  # refused before any stack starts
        main(["--splits", "1+1:auto,3:on"])
    assert done.value.code == 2
