"""The chart's output-parsing values (tool-call format, reasoning parser) in the Serve config
it renders, and the schema's refusal of a parser kvray does not have."""

from __future__ import annotations

import pytest

from tests.helm.helpers import only, serve_config


def _args(render, values) -> dict:
    return serve_config(only(render(values), "RayService"))["applications"][0]["args"]


def test_the_parsers_reach_the_app_only_when_set(render) -> None:
    from cluster.config import ServeConfig

    args = _args(render, None)
    assert "tool_call_parser" not in args and "reasoning_parser" not in args
    values = {"engine": {"toolCallParser": "qwen3_coder", "reasoningParser": "qwen3"}}
    config = ServeConfig.from_args(_args(render, values))
    assert config.parsing.tool_call_parser == "qwen3_coder"
    assert config.parsing.reasoning_parser == "qwen3"


@pytest.mark.parametrize(
    ("key", "value"), [("toolCallParser", "granite"), ("reasoningParser", "off")]
)
def test_the_schema_names_an_unknown_parser(render, key: str, value: str) -> None:
    with pytest.raises(Exception) as info:
        render({"engine": {key: value}})
    assert key in str(info.value)
