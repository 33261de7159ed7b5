"""The preparation both ingresses share (cluster/ingress/prepare.py), without Ray: an OpenAI
body and a kvray.v1 GenerateRequest asking the same become the same engine input; each
request's tool use and output constraint are parsed once; errors name the field where each
API's client wrote it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from cluster.errors import InvalidRequestError
from cluster.grpc_api import constraints
from cluster.grpc_api import convert as conv
from cluster.grpc_api.client import build_generate_request
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.ingress import structured, tools
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.prepare import Prepared, Preparer, Source
from cluster.ingress.prompts import Prompts
from workers.inputs import InputChecker
from workers.lora.request import LoRARequest
from workers.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "time", "description": "Now"}},
]
USER = [{"role": "user", "content": "What is the weather?"}]
# A schema object the grammar backend refuses (an unknown type).
BAD = {"type": "object", "properties": {"a": {"type": "nope"}}}


class FakeClient:
    """LLMClient's input_checker, with the demo model's limits."""

    def __init__(self, vocab_size: int, max_model_len: int = 2048) -> None:
        self.checker = InputChecker(vocab_size=vocab_size, max_model_len=max_model_len)

    async def input_checker(self) -> InputChecker:
        return self.checker


@pytest.fixture(scope="module")
def preparer() -> Preparer:
    from workers.demo import demo_model_dir
    from workers.tokenizer import Tokenizer

    prompts = Prompts(Tokenizer.from_pretrained(demo_model_dir()))
    return Preparer(prompts, FakeClient(prompts.vocab_size), DEFAULT_LIMITS)


def _prepare(preparer: Preparer, source: Source) -> Prepared:
    return asyncio.run(preparer.prepare(source))


def _http_chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=USER, **kw)


def _grpc_chat(stream: bool = False, **kw: Any) -> conv.GenerateSource:
    return conv.GenerateSource(build_generate_request(messages=USER, **kw), stream=stream)


def test_both_apis_prepare_the_same_engine_input(preparer: Preparer) -> None:
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=8, temperature=0.0)
    http = _prepare(preparer, _http_chat(**kw))
    grpc = _prepare(preparer, _grpc_chat(**kw))
    assert http.inputs == grpc.inputs and len(http.inputs) == 1
    assert http.params == grpc.params and http.params.max_tokens == 8
    # The template listed the tools; the constraint is the tool calls' (in the deployment's
    # format, hermes by default: <tool_call> blocks).
    assert http.tool_use == grpc.tool_use and http.tool_use is not None
    assert http.constraint is not None and grpc.constraint is not None
    assert (http.constraint.field, grpc.constraint.field) == ("tools", "chat.tools")
    assert http.params.structured_outputs == http.constraint.spec
    assert "<tool_call>" in (http.constraint.spec.grammar or "")
    plain = _prepare(preparer, _http_chat(max_tokens=8, temperature=0.0))
    assert len(plain.inputs[0].prompt_token_ids) < len(http.inputs[0].prompt_token_ids)
    (req,) = http.requests("chatcmpl-1")
    assert req.request_id == "chatcmpl-1" and req.input is http.inputs[0]


def test_priority_reaches_the_engine_input_from_both_apis(preparer: Preparer) -> None:
    http = _prepare(preparer, _http_chat(max_tokens=4, priority=-3))
    grpc = _prepare(preparer, _grpc_chat(max_tokens=4, priority=-3))
    assert http.inputs == grpc.inputs and http.inputs[0].priority == -3
    assert _prepare(preparer, _http_chat(max_tokens=4)).inputs[0].priority == 0


def test_a_completion_batch_is_one_input_per_prompt(preparer: Preparer) -> None:
    body = CompletionRequest(prompt=["Once upon", "a time"], max_tokens=4, stream=True)
    prepared = _prepare(preparer, body)
    assert [r.request_id for r in prepared.requests("cmpl-x")] == ["cmpl-x-0", "cmpl-x-1"]
    assert prepared.params == body.sampling_params() and prepared.tool_use is None
    text = _prepare(preparer, conv.GenerateSource(build_generate_request("a time"), stream=True))
    assert text.inputs[0].prompt_token_ids == prepared.inputs[1].prompt_token_ids


def test_the_inputs_are_final_under_the_adapter_and_for_the_tenant(preparer: Preparer) -> None:
    lora = LoRARequest("a", 1, "/x/a", "kvray-demo")
    body = CompletionRequest(prompt=["Once upon", "a time"], max_tokens=4)
    prepared = asyncio.run(preparer.prepare(body, lora=lora, tenant="acme"))
    assert [(inp.lora, inp.tenant) for inp in prepared.inputs] == [(lora, "acme")] * 2
    base = _prepare(preparer, body)
    assert [(inp.lora, inp.tenant) for inp in base.inputs] == [(None, None)] * 2


@pytest.mark.parametrize("count", [1, 6])
def test_sampling_params_are_validated_once_per_request_not_per_prompt(
    preparer: Preparer, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    calls: Counter = Counter()
    _counting(monkeypatch, calls, SamplingParams, "validate")
    body = CompletionRequest(prompt=["Once upon a time"] * count, max_tokens=4)
    prepared = _prepare(preparer, body)
    assert len(prepared.inputs) == count
    # Once when built, once by the input check (a SamplingParams may change after it is
    # built), whatever the number of prompts.
    assert calls["validate"] == 2


def _counting(monkeypatch: pytest.MonkeyPatch, calls: Counter, owner: Any, name: str) -> None:
    """Replaces owner.name by a wrapper that counts its calls."""
    fn: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_tools_and_constraint_are_parsed_once_per_request(
    preparer: Preparer, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    calls: Counter = Counter()
    # What reads the request's tools, its own constraint, and the tool calls' constraint.
    if api == "http":
        _counting(monkeypatch, calls, tools, "tool_use")
        _counting(monkeypatch, calls, structured, "from_openai")
    else:
        _counting(monkeypatch, calls, constraints, "tool_use")
        _counting(monkeypatch, calls, constraints, "sampling_constraint")
    _counting(monkeypatch, calls, tools.ToolUse, "constraint")
    _counting(monkeypatch, calls, structured, "check")
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    prepared = _prepare(preparer, _http_chat(**kw) if api == "http" else _grpc_chat(**kw))
    assert prepared.constraint is not None and prepared.tool_use is not None
    own = "from_openai" if api == "http" else "sampling_constraint"
    # Each compile check once too: every tool's parameters, and the constraint.
    want = Counter({"tool_use": 1, own: 1, "constraint": 1, "check": len(TOOLS) + 1})
    assert calls == want, calls


@pytest.mark.parametrize(
    ("http", "grpc", "http_field", "grpc_field"),
    [
        (  # the request's own constraint and the tool calls': both named, the second blamed
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"},
            {"tools": TOOLS, "tool_choice": "required", "regex": "a+"},
            "tools",
            "chat.tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            {"tools": TOOLS, "tool_choice": {"name": "x"}},
            "tool_choice.function.name",
            "chat.tool_choice.function_name",
        ),
        (  # a schema that does not compile fails its compile check, naming the tool
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD}}]},
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD}}]},
            "tools[0].function.parameters",
            "chat.tools[0].parameters_json",
        ),
        ({"guided_regex": "("}, {"regex": "("}, "guided_regex", "sampling.regex"),
        ({"max_tokens": 10_000}, {"max_tokens": 10_000}, "max_tokens", "max_tokens"),
    ],
)
def test_errors_name_the_field_each_api_wrote(
    preparer: Preparer, http: dict, grpc: dict, http_field: str, grpc_field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        _prepare(preparer, _http_chat(**http))
    assert err.value.param == http_field, err.value.message
    with pytest.raises(InvalidRequestError) as err:
        _prepare(preparer, _grpc_chat(**grpc))
    assert err.value.param == grpc_field, err.value.message


@pytest.mark.parametrize("kw", [{"prompt_logprobs": 21}, {"max_tokens": 0}, {"top_p": 2.0}])
def test_a_field_both_apis_take_is_checked_in_one_place(preparer: Preparer, kw: dict) -> None:
    """SamplingParams' checks alone: the same message from both APIs."""
    messages = []
    for source in (_http_chat(**kw), _grpc_chat(**kw)):
        with pytest.raises(InvalidRequestError) as err:
            _prepare(preparer, source)
        messages.append(err.value.message)
    assert messages[0] == messages[1], messages


def test_prompt_checks_come_first(preparer: Preparer) -> None:
    # The prompt's own bounds are checked before anything else (here a bad top_p too).
    limits = replace(DEFAULT_LIMITS, max_chat_messages=1, max_prompts_per_request=1)
    small = Preparer(preparer.prompts, preparer.client, limits)
    with pytest.raises(InvalidRequestError) as err:
        _prepare(small, ChatCompletionRequest(messages=USER * 2, top_p=5.0))
    assert err.value.param == "messages"
    with pytest.raises(InvalidRequestError) as err:
        _prepare(small, CompletionRequest(prompt=["a", "b"]))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        _prepare(
            small, conv.GenerateSource(build_generate_request(messages=USER * 2), stream=False)
        )
    assert err.value.param == "chat.messages"
