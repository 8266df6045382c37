from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import build_model_dirs  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random models saved with save_pretrained: target, draft, gpt2, other_vocab."""
    return build_model_dirs(str(tmp_path_factory.mktemp("models")))
