"""The output-parsing section: how the ingresses read a model's answer — its tool calls
(`tool_call_parser`, the format the model family writes them in) and its reasoning
(`reasoning_parser`, the thinking a reasoning model writes before its answer). Both are read
at the ingress (cluster/ingress/tool_formats/, cluster/ingress/reasoning.py); the engine only
needs to know where the reasoning ends, so that structured outputs apply to the answer alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.checks import need
from cluster.config.setting import MODEL_GROUP, setting

# vLLM's names. "auto": read from the chat template (cluster/ingress/tool_formats/).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic")
# The families kvray serves that think: Qwen3 writes <think>...</think> itself; DeepSeek-R1's
# template opens the <think> block, so its output starts inside the reasoning.
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ParsingSettings:
    """How the model's output is read into tool calls and reasoning."""

    tool_call_parser: str = setting(
        "auto",
        "the format the model writes tool calls in (vLLM's parser names); auto: read from "
        "the chat template, hermes (<tool_call> JSON blocks) when it says nothing",
        MODEL_GROUP,
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = setting(
        None,
        "separate a reasoning model's thinking from its answer: reasoning_content in chat "
        "completions, reasoning items in Responses, thinking blocks in Messages "
        "(default: off, the thinking stays in the answer)",
        MODEL_GROUP,
        choices=REASONING_PARSERS,
    )

    def __post_init__(self) -> None:
        p = self.tool_call_parser
        need(p in TOOL_CALL_PARSERS, "tool_call_parser", f"must be one of {TOOL_CALL_PARSERS}", p)
        r = self.reasoning_parser
        need(
            r is None or r in REASONING_PARSERS,
            "reasoning_parser",
            f"must be one of {REASONING_PARSERS} or null",
            r,
        )
