"""kvray.v1.LLMService's answers end to end: a real local Ray cluster running `build_app`
(tests/cluster/grpc_api/conftest.py), real grpcio clients, the official `openai` client for the
HTTP side, and the offline engine as the oracle."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from cluster.grpc_api.client import KvrayClient, completion_text
from kvray.v1 import llm_pb2
from tests.cluster.grpc_api.grpc_helpers import (
    CHAT,
    CHAT_MAX_TOKENS,
    PROMPTS,
    Offline,
)

pytestmark = pytest.mark.slow


def test_list_models_and_tokenize(client: KvrayClient, offline: Offline) -> None:
    (model,) = client.list_models()
    assert model.id == "kvray-demo" and model.owned_by == "kvray" and model.max_model_len > 0
    assert client.tokenize("Once upon a time") == offline.ids_prompt
    assert client.tokenize(messages=CHAT) == offline.chat_prompt_ids


def test_outputs_equal_the_offline_engine(client: KvrayClient, offline: Offline) -> None:
    for prompt, text, ids in zip(PROMPTS, offline.texts, offline.token_ids, strict=True):
        # Unset max_tokens means 16, as in /v1/completions.
        unary = client.generate(prompt, temperature=0.0)
        (c,) = unary.completions
        assert (c.text, list(c.token_ids)) == (text, ids)
        assert c.finish_reason == llm_pb2.FINISH_REASON_LENGTH
        assert unary.usage.completion_tokens == len(ids)

        pieces = list(client.generate_stream(prompt, temperature=0.0))
        assert "".join(completion_text(p) for p in pieces) == text
        assert [t for p in pieces for c in p.completions for t in c.token_ids] == ids
        assert [p.HasField("usage") for p in pieces] == [False] * (len(pieces) - 1) + [True]
        assert pieces[-1].completions[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH

    by_ids = client.generate(offline.ids_prompt, temperature=0.0)
    assert list(by_ids.completions[0].token_ids) == offline.ids_prompt_out
    assert by_ids.usage.prompt_tokens == len(offline.ids_prompt)


def test_chat_goes_through_the_template(client: KvrayClient, offline: Offline) -> None:
    resp = client.generate(messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0)
    assert resp.completions[0].text == offline.chat_text
    assert list(resp.completions[0].token_ids) == offline.chat_ids
    assert resp.usage.prompt_tokens == len(offline.chat_prompt_ids)
    streamed = client.generate_stream(messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0)
    assert "".join(completion_text(p) for p in streamed) == offline.chat_text


def test_outputs_equal_the_http_api(
    client: KvrayClient, openai_client: Any, offline: Offline
) -> None:
    http = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[0], max_tokens=16, temperature=0.0
    )
    assert http.choices[0].text == offline.texts[0]
    chat = openai_client.chat.completions.create(
        model="kvray-demo", messages=CHAT, max_tokens=CHAT_MAX_TOKENS, temperature=0.0
    )
    assert chat.choices[0].message.content == offline.chat_text

    # Seeded sampling: the same options mean the same draw on both APIs.
    opts = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=12)
    http_sampled = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[1], extra_body={"top_k": 40}, **opts
    )
    grpc_sampled = client.generate(PROMPTS[1], top_k=40, **opts)
    assert completion_text(grpc_sampled) == http_sampled.choices[0].text

    # n = 2 with a seed: both samples, in index order, equal the HTTP API's.
    http_n = openai_client.completions.create(model="kvray-demo", prompt=PROMPTS[0], n=2, **opts)
    grpc_n = client.generate(PROMPTS[0], n=2, **opts)
    assert [c.index for c in grpc_n.completions] == [0, 1]
    assert [c.text for c in grpc_n.completions] == [
        c.text for c in sorted(http_n.choices, key=lambda c: c.index)
    ]


def test_logprobs_equal_the_http_api(client: KvrayClient, openai_client: Any) -> None:
    resp = client.generate(PROMPTS[0], max_tokens=6, temperature=0.0, top_logprobs=2)
    (c,) = resp.completions
    assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    for lp in c.logprobs:
        assert len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert lp.top_logprobs[0].token_id == lp.token_id  # greedy picks the top token

    http = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[0], max_tokens=6, temperature=0.0, logprobs=2
    )
    hl = http.choices[0].logprobs
    assert [lp.token for lp in c.logprobs] == hl.tokens
    assert [lp.logprob for lp in c.logprobs] == pytest.approx(hl.token_logprobs, abs=1e-6)
    for lp, top in zip(c.logprobs, hl.top_logprobs, strict=True):
        assert {t.token: pytest.approx(t.logprob, abs=1e-6) for t in lp.top_logprobs} == top

    streamed = list(
        client.generate_stream(PROMPTS[0], max_tokens=6, temperature=0.0, top_logprobs=2)
    )
    assert [lp for p in streamed for s in p.completions for lp in s.logprobs] == list(c.logprobs)


def test_prompt_logprobs_equal_the_http_api(client: KvrayClient, openai_client: Any) -> None:
    reply = client.generate(PROMPTS[0], max_tokens=1, prompt_logprobs=1)
    http = openai_client.completions.create(
        model="kvray-demo", prompt=PROMPTS[0], max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    want = http.choices[0].model_extra["prompt_logprobs"]
    # gRPC leaves out the first prompt token (nothing predicts it); HTTP answers it null.
    assert want[0] is None and len(reply.prompt_logprobs) == len(want) - 1 > 0
    for got, entry in zip(reply.prompt_logprobs, want[1:], strict=True):
        assert got.logprob == pytest.approx(entry[str(got.token_id)]["logprob"], abs=1e-6)
        top = [int(t) for t, e in entry.items() if e["rank"] == 1]
        assert [t.token_id for t in got.top_logprobs] == top
    # Streamed: once, on the first message that has them.
    pieces = list(client.generate_stream(PROMPTS[0], max_tokens=4, prompt_logprobs=1))
    sent = [list(p.prompt_logprobs) for p in pieces if p.prompt_logprobs]
    assert sent == [list(reply.prompt_logprobs)]


# -- structured outputs and tool calls -----------------------------------------------------------

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,5} [0-9]{2}"
CHOICES = ["north", "south", "east west"]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "noop"}},
]


def _both(client: KvrayClient, **kw: Any) -> list[tuple[str, int, list[llm_pb2.ToolCall]]]:
    """(text, finish_reason, tool calls) of completion 0, from Generate and GenerateStream."""
    unary = client.generate(**kw).completions[0]
    pieces = [c for p in client.generate_stream(**kw) for c in p.completions]
    streamed = (
        "".join(c.text for c in pieces),
        pieces[-1].finish_reason,
        [t for c in pieces for t in c.tool_calls],
    )
    return [(unary.text, unary.finish_reason, list(unary.tool_calls)), streamed]


def test_constrained_outputs(client: KvrayClient) -> None:
    import jsonschema

    stop = llm_pb2.FINISH_REASON_STOP
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        opts = {"messages": CHAT, "max_tokens": 120, **sampling}
        for text, finish, _ in _both(client, json_schema=ITEM, **opts):
            assert finish == stop
            jsonschema.validate(json.loads(text), ITEM)
        for text, finish, _ in _both(client, regex=REGEX, **opts):
            assert finish == stop and re.fullmatch(REGEX, text), text
        for text, finish, _ in _both(client, choice=CHOICES, **opts):
            assert finish == stop and text in CHOICES
        for text, finish, _ in _both(client, grammar='start: "on" | "off"', **opts):
            assert finish == stop and text in ("on", "off")
    # Text prompts take constraints too.
    (text, _, _), _ = _both(client, prompt="x", regex="[0-9]{4}", max_tokens=9)
    assert re.fullmatch("[0-9]{4}", text)


def test_required_and_named_tool_calls(client: KvrayClient) -> None:
    import jsonschema

    for choice, names, parallel in (
        ("required", {"weather", "noop"}, False),
        ({"name": "weather"}, {"weather"}, None),
    ):
        for text, finish, calls in _both(
            client,
            messages=CHAT,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_tokens=200,
            temperature=0.0,
        ):
            assert finish == llm_pb2.FINISH_REASON_TOOL_CALLS and text == ""
            assert len(calls) == 1
            for call in calls:
                assert call.name in names and call.id.startswith("call_")
                schema = CITY if call.name == "weather" else {"type": "object", "maxProperties": 0}
                jsonschema.validate(json.loads(call.arguments), schema)


def test_bad_constraints_and_tools_are_invalid_argument(client: KvrayClient) -> None:
    import grpc

    cases = [
        ({"prompt": "x", "regex": "[a-"}, "sampling.regex"),
        ({"prompt": "x", "json_schema": {"type": "strin"}}, "sampling.json_schema"),
        ({"prompt": "x", "grammar": "start: ("}, "sampling.grammar"),
        (
            {"messages": CHAT, "tools": TOOLS, "tool_choice": {"name": "nope"}},
            "chat.tool_choice.function_name",
        ),
        ({"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "regex": "a"}, "chat.tools"),
        (
            {
                "messages": CHAT,
                "tools": [
                    {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "x"}}},
                    }
                ],
            },
            "chat.tools[0].parameters_json",
        ),
    ]
    for kw, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(max_tokens=4, **kw)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}: "), err.value.details()
