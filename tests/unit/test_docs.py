"""README.md stays true: every service flag and every metric the code defines is documented."""

from __future__ import annotations

import dataclasses
import os
import re

from coordinator.__main__ import CoordinatorSettings
from draft_worker.__main__ import DraftSettings
from target_worker.__main__ import TargetSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_every_service_flag_is_in_the_readme():
    text = readme()
    for cls in (CoordinatorSettings, TargetSettings, DraftSettings):
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            assert f"`{flag}`" in text, f"{cls.__name__}: {flag} is not documented in README.md"


def test_every_metric_is_in_the_readme():
    with open(os.path.join(ROOT, "specdec", "serving", "metrics.py"), encoding="utf-8") as f:
        names = set(re.findall(r'"(specdec_[a-z_]+)"', f.read()))
    assert len(names) > 10
    text = readme()
    for name in names:
        assert name in text, f"metric {name} is not documented in README.md"


def test_readme_names_the_two_commands():
    text = readme()
    assert "make run" in text and "make test" in text
