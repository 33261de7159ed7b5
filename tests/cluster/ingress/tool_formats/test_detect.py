"""What `auto` picks from a chat template (cluster/ingress/tool_formats/detect.py)."""

from __future__ import annotations

import pytest

from cluster.ingress.tool_formats import detect_tool_format
from tests.cluster.ingress.tool_formats import (
    test_hermes,
    test_llama3_json,
    test_mistral,
    test_pythonic,
    test_qwen3_coder,
)

# The parts of each family's template that name its format (how it shows past calls, or
# tells the model to call).
LLAMA32_JSON = """{%- if tools %}Environment: ipython
Respond with a JSON for a function call in the format
{"name": function name, "parameters": dictionary of argument name and its value}.{% endif %}
{%- for m in messages %}{% if m.role == 'ipython' %}<|start_header_id|>ipython{% endif %}
{%- endfor %}"""
LLAMA4_JSON = """{%- for tc in message.tool_calls %}<|python_start|>{{ m.content }}<|python_end|>
{{- '{"name": "' + tc.function.name + '", "parameters": ' }}{{ tc.function.arguments|tojson }}}
{%- endfor %}{% if m.role == 'ipython' %}<|header_start|>ipython<|header_end|>{% endif %}"""
LLAMA32_PYTHONIC = """Environment: ipython
Reply with a python list of the calls: [func_name1(params_name1=params_value1), func_name2()]
{%- for tc in m.tool_calls %}{{- tc.name + '(' -}}{% endfor %}"""
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (test_hermes.TEMPLATE, "hermes"),
        (test_qwen3_coder.TEMPLATE, "qwen3_coder"),
        (test_mistral.ARRAY_TEMPLATE, "mistral"),
        (test_mistral.NAMED_TEMPLATE, "mistral"),
        (test_llama3_json.TEMPLATE, "llama3_json"),
        (LLAMA32_JSON, "llama3_json"),
        (LLAMA4_JSON, "llama3_json"),
        (test_pythonic.TEMPLATE, "pythonic"),
        (LLAMA32_PYTHONIC, "pythonic"),
        (CHATML, "hermes"),
        ("", "hermes"),
        (None, "hermes"),
    ],
)
def test_the_template_names_the_format(template: str | None, fmt: str) -> None:
    assert detect_tool_format(template) == fmt
