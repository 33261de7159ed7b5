"""The serving-limits section checks itself."""

from __future__ import annotations

import pytest

from cluster.config.limits import DEFAULT_MAX_QUEUED_TOKENS, LimitSettings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_n": 0}, r"^max_n must be an integer >= 1, got 0"),
        ({"queue_timeout_s": -1}, r"^queue_timeout_s must be a number >= 0 \(0: no limit\)"),
        ({"request_timeout_s": 0}, r"^request_timeout_s must be a number > 0 or null"),
        ({"max_queued_tokens": 1.5}, r"^max_queued_tokens must be an integer >= 1"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LimitSettings(**kwargs)


def test_defaults() -> None:
    limits = LimitSettings()
    assert limits.max_queued_tokens == DEFAULT_MAX_QUEUED_TOKENS == 2**18
    assert limits.queue_timeout_s == 60.0 and limits.request_timeout_s is None
