"""The tracing section: an http(s) endpoint and a ratio in [0, 1]."""

from __future__ import annotations

import pytest

from cluster.config.tracing import TracingSettings


def test_off_by_default() -> None:
    assert TracingSettings().otlp_endpoint is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"otlp_endpoint": "collector:4318"}, "otlp_endpoint"),
        ({"otlp_sample_ratio": 1.5}, "otlp_sample_ratio"),
        ({"otlp_sample_ratio": float("nan")}, "otlp_sample_ratio"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        TracingSettings(**kwargs)
