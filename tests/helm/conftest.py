"""Fixtures rendering helm/kvray with the real Helm engine (helm-python-sdk binds Helm's Go
library). Offline: no cluster, no network."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.helm.helpers import CHART_DIR, NAMESPACE, RELEASE, parse_manifests

RenderFn = Callable[[dict[str, Any] | None], list[dict[str, Any]]]


@pytest.fixture(scope="session")
def chart():
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart) -> RenderFn:
    """Values -> rendered objects (NOTES.txt and empty templates left out)."""

    def _render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        return parse_manifests(manifests)

    return _render
