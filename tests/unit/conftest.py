from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def chart():
    """The Helm chart deploy/helm/specdec, loaded by the real Helm engine (helm-python-sdk;
    pinned in the dev extras: a broken install fails the tests that use it, not skips them)."""
    import helm_python as helm
    from helm_render import CHART_DIR

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
