"""What tool-call format `auto` picks: the one the model's chat template teaches it.

A template shows the model its own past calls (how it renders an assistant turn's
`tool_calls`), and a model writes new calls the way its template wrote the old ones, so the
template's text names the format. The marks are checked most specific first: Qwen3-Coder's
template also has `<tool_call>`, and Llama 3.2's pythonic template also mentions `ipython`.
"""

from __future__ import annotations

import re

# A template that renders a call as `name(` ... `)`: `tool_call.name + '('`, `{{ fn.name }}(`.
_PYTHONIC_RENDER = re.compile(r"""\.name\s*(?:[+~]\s*['"]|-?\}\})\(""")


def detect_tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template's text implies; "hermes" when nothing says."""
    t = chat_template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if _PYTHONIC_RENDER.search(t) or "python list" in t.lower() or "[func_name1(" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return "hermes"
