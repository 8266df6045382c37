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


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct converted from its wheel's GGUF, once per machine (cached in
    $SPECDEC_MODEL_CACHE, default ~/.cache/specdec/models)."""
    from specdec.catalog import SMOLLM2
    from specdec.engine.convert import ensure

    return str(ensure(SMOLLM2.name))
