"""The shared checks: their messages name the field and the value."""

from __future__ import annotations

import pytest

from cluster.config.checks import is_http_url, is_int, is_num, need


def test_need_names_the_field_and_the_value() -> None:
    need(True, "x", "must be fine", 1)
    with pytest.raises(ValueError, match=r"^x must be fine, got 'bad'$"):
        need(False, "x", "must be fine", "bad")


def test_numbers_are_not_bools() -> None:
    assert is_int(3) and not is_int(True) and not is_int(3.0)
    assert is_num(2.5) and not is_num(False) and not is_num(float("inf"))


def test_http_urls_need_a_host() -> None:
    assert is_http_url("http://collector:4318") and is_http_url("https://x/v1/traces")
    assert not is_http_url("collector:4318") and not is_http_url("http://")
