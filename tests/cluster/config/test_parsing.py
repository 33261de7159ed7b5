"""The output-parsing section: the tool-call format and the reasoning parser, by vLLM's names."""

from __future__ import annotations

import pytest

from cluster.config import ServeConfig
from cluster.config.parsing import REASONING_PARSERS, TOOL_CALL_PARSERS, ParsingSettings


def test_defaults_read_the_template_and_leave_reasoning_in_the_answer() -> None:
    s = ParsingSettings()
    assert (s.tool_call_parser, s.reasoning_parser) == ("auto", None)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tool_call_parser": "granite"}, "tool_call_parser"),
        ({"tool_call_parser": None}, "tool_call_parser"),
        ({"reasoning_parser": "gpt_oss"}, "reasoning_parser"),
        ({"reasoning_parser": ""}, "reasoning_parser"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        ParsingSettings(**kwargs)


def test_flat_keys_and_flags() -> None:
    config = ServeConfig.from_args({"tool_call_parser": "mistral", "reasoning_parser": "qwen3"})
    assert config.parsing == ParsingSettings("mistral", "qwen3")
    assert config.to_args()["reasoning_parser"] == "qwen3"


def test_every_tool_format_has_a_parser() -> None:
    from cluster.ingress.tool_formats import TOOL_CALL_FORMATS

    assert set(TOOL_CALL_PARSERS) == set(TOOL_CALL_FORMATS)
    assert "qwen3" in REASONING_PARSERS and "deepseek_r1" in REASONING_PARSERS
