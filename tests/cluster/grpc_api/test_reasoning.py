"""Reasoning over gRPC, no server: ChatMessages' chat_template_kwargs_json and
thinking_token_budget read and checked as the HTTP API's fields are (errors name the proto
field), and a chat Completion split into `text` (the answer) and `reasoning` (the thinking),
the same whole (Generate) and streamed (GenerateStream), tool calls read from the answer only
(cluster/grpc_api/convert.py, answer.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from cluster.config.parsing import ParsingSettings
from cluster.errors import InvalidRequestError
from cluster.grpc_api import constraints
from cluster.grpc_api import convert as conv
from cluster.grpc_api.client import build_generate_request
from cluster.grpc_api.servicer import status_for
from cluster.http.protocol import ChatCompletionRequest
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.output_parsing import OutputParsing, Reasoning
from cluster.ingress.prepare import Prepared, Preparer
from cluster.ingress.prompts import Prompts
from kvray.v1 import llm_pb2
from workers.inputs import InputChecker
from workers.outputs import CompletionOutput, RequestOutput

USER = [{"role": "user", "content": "2+2?"}]
KWARGS_FIELD = "chat.chat_template_kwargs_json"
BUDGET_FIELD = "chat.thinking_token_budget"
QWEN3 = Reasoning("qwen3", inside=False, may_open=True)  # writes its own <think>
R1 = Reasoning("deepseek_r1", inside=True)  # the prompt opened <think>
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


# -- requests ----------------------------------------------------------------------------------


def test_the_fields_reach_the_prompt_input() -> None:
    req = build_generate_request(
        messages=USER, chat_template_kwargs={"enable_thinking": True}, thinking_token_budget=64
    )
    assert json.loads(req.chat.chat_template_kwargs_json) == {"enable_thinking": True}
    prompt = conv.GenerateSource(req, stream=False).prompt_input(DEFAULT_LIMITS)
    assert prompt.template_kwargs == {"enable_thinking": True}
    assert (prompt.thinking_budget, prompt.budget_field) == (64, BUDGET_FIELD)
    # A budget of 0 is a budget (answer at once), not unset.
    zero = conv.prompt_of(build_generate_request(messages=USER, thinking_token_budget=0))
    assert zero.thinking_budget == 0
    unset = conv.prompt_of(build_generate_request(messages=USER))
    assert (unset.template_kwargs, unset.thinking_budget) == (None, None)
    # Tokenize's chat reads the template variables too (its budget is ignored).
    tok = llm_pb2.TokenizeRequest(chat=req.chat)
    assert conv.prompt_of(tok).template_kwargs == {"enable_thinking": True}


def test_the_client_keeps_chat_fields_for_chats() -> None:
    with pytest.raises(ValueError, match="need messages"):
        build_generate_request("hi", chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match="need messages"):
        build_generate_request("hi", thinking_token_budget=8)
    assert not build_generate_request(messages=USER).chat.HasField("thinking_token_budget")


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '"x"', "null", "1", '{"a": 1'])
def test_template_kwargs_that_are_not_an_object_are_named(text: str) -> None:
    req = build_generate_request(messages=USER)
    req.chat.chat_template_kwargs_json = text
    with pytest.raises(InvalidRequestError) as err:
        conv.prompt_of(req)
    assert err.value.field == KWARGS_FIELD
    code, details = status_for(err.value, "chat")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{KWARGS_FIELD}: ")


def test_a_reserved_template_variable_names_the_proto_field() -> None:
    # The template runner (cluster/ingress/prompts.py) names the HTTP field; gRPC maps it.
    err = InvalidRequestError("chat_template_kwargs", "chat_template_kwargs cannot set tools")
    code, details = status_for(err, "chat")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{KWARGS_FIELD}: ")


class _Client:
    """LLMClient's input_checker, with the demo model's limits."""

    def __init__(self, vocab_size: int) -> None:
        self.checker = InputChecker(vocab_size=vocab_size, max_model_len=2048)

    async def input_checker(self) -> InputChecker:
        return self.checker


@pytest.fixture(scope="module")
def preparers() -> dict[str | None, Preparer]:
    """The demo model's Preparer without (None) and with the qwen3 reasoning parser."""
    from workers.demo import demo_model_dir
    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(demo_model_dir())
    prompts = Prompts(tokenizer)
    client = _Client(prompts.vocab_size)
    qwen3 = OutputParsing.of(ParsingSettings(reasoning_parser="qwen3"), tokenizer)
    return {
        None: Preparer(prompts, client, DEFAULT_LIMITS),
        "qwen3": Preparer(prompts, client, DEFAULT_LIMITS, qwen3),
    }


def _prepare(preparer: Preparer, **kw: Any) -> Prepared:
    source = conv.GenerateSource(build_generate_request(messages=USER, **kw), stream=False)
    return asyncio.run(preparer.prepare(source))


def test_both_apis_render_the_same_template_variables(preparers: dict) -> None:
    # The demo template opens <think> for enable_thinking: the output starts inside it.
    preparer = preparers["qwen3"]
    on = {"enable_thinking": True}
    grpc_prep = _prepare(preparer, chat_template_kwargs=on, thinking_token_budget=16)
    http = ChatCompletionRequest(messages=USER, chat_template_kwargs=on, thinking_token_budget=16)
    http_prep = asyncio.run(preparer.prepare(http))
    assert grpc_prep.inputs[0].prompt_token_ids == http_prep.inputs[0].prompt_token_ids
    assert grpc_prep.outputs.reasoning == http_prep.outputs.reasoning
    assert grpc_prep.outputs.reasoning is not None and grpc_prep.outputs.reasoning.inside
    assert grpc_prep.params.thinking_budget == http_prep.params.thinking_budget
    assert grpc_prep.params.thinking_budget is not None
    assert grpc_prep.params.thinking_budget.budget == 16
    plain = _prepare(preparer)
    assert plain.outputs.reasoning == Reasoning("qwen3", inside=False, may_open=True)
    assert plain.inputs[0].prompt_token_ids != grpc_prep.inputs[0].prompt_token_ids


def test_a_budget_needs_a_reasoning_parser(preparers: dict) -> None:
    assert _prepare(preparers[None]).outputs.reasoning is None
    with pytest.raises(InvalidRequestError) as err:
        _prepare(preparers[None], thinking_token_budget=16)
    assert err.value.field == BUDGET_FIELD
    code, details = status_for(err.value, "chat")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{BUDGET_FIELD}: ")


def test_a_reserved_template_variable_is_refused(preparers: dict) -> None:
    with pytest.raises(InvalidRequestError) as err:
        _prepare(preparers[None], chat_template_kwargs={"add_generation_prompt": False})
    assert status_for(err.value, "chat")[1].startswith(f"{KWARGS_FIELD}: ")


class _Handle:
    """Stands in for the LLMServer handle: _prepare sends nothing."""

    def options(self, **_: Any) -> _Handle:
        return self


def test_the_servicer_answers_with_the_requests_reasoning(preparers: dict) -> None:
    from cluster.grpc_api.servicer import LLMServicer
    from cluster.ingress.auth import ApiKeyAuth

    servicer = LLMServicer(_Handle(), None, served_model="demo", auth=ApiKeyAuth(None))
    servicer._preparer = preparers["qwen3"]  # the demo tokenizer, the qwen3 parser, no Ray
    req = build_generate_request(
        messages=USER, chat_template_kwargs={"enable_thinking": True}, thinking_token_budget=4
    )
    llm_req, ctx = asyncio.run(servicer._prepare(req, stream=True))
    assert ctx.reasoning == Reasoning("qwen3", inside=True)
    budget = llm_req.input.params.thinking_budget
    assert budget is not None and budget.budget == 4


# -- responses ---------------------------------------------------------------------------------


def _ctx(reasoning: Reasoning | None, tools: bool = False) -> conv.ResponseContext:
    use = None
    if tools:
        use = constraints.tool_use(build_generate_request(messages=USER, tools=TOOLS).chat)
    return conv.ResponseContext("r", "m", tools=use, reasoning=reasoning)


def _whole(text: str, ctx: conv.ResponseContext) -> llm_pb2.Completion:
    out = RequestOutput("r", None, [1], [CompletionOutput(0, text, [1], "stop")], True)
    (c,) = conv.final_response(out, ctx).completions
    return c


def _streamed(text: str, ctx: conv.ResponseContext, size: int) -> list[llm_pb2.Completion]:
    """The completions of a GenerateStream whose output arrives `size` characters a step."""
    state, got = conv.StreamState(), []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = CompletionOutput(
            0, "", [], "stop" if last else None, delta_text=piece, delta_token_ids=[i]
        )
        msg = conv.stream_response(RequestOutput("r", None, [1], [delta], last), state, ctx)
        if msg is not None:
            got.extend(msg.completions)
    return got


SPLITS = [
    (QWEN3, "<think>\nLet me see.\n</think>\n\nHello!", "Let me see.", "Hello!"),
    (QWEN3, "Hello!", "", "Hello!"),  # no thinking: all answer
    (R1, "Two and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    (R1, "still thinking ", "still thinking", ""),  # cut off while thinking
    (None, "<think>x</think>y", "", "<think>x</think>y"),  # parser off: as written
]


@pytest.mark.parametrize(("reasoning", "text", "thought", "answer"), SPLITS)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_whole_and_streamed_split_the_same(
    reasoning: Reasoning | None, text: str, thought: str, answer: str, size: int
) -> None:
    whole = _whole(text, _ctx(reasoning))
    assert (whole.reasoning, whole.text) == (thought, answer)
    assert whole.finish_reason == llm_pb2.FINISH_REASON_STOP
    streamed = _streamed(text, _ctx(reasoning), size)
    assert "".join(c.reasoning for c in streamed) == thought
    assert "".join(c.text for c in streamed) == answer
    # The thinking comes first: no reasoning after the first piece of answer.
    first_text = next((i for i, c in enumerate(streamed) if c.text), len(streamed))
    assert not any(c.reasoning for c in streamed[first_text + 1 :])
    assert streamed[-1].finish_reason == llm_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls_are_read_from_the_answer_only(size: int) -> None:
    # A call the model rehearses while thinking stays in the thinking and is not called.
    text = f"<think>I could call {CALL}.</think>\n\nSure.{CALL}"
    ctx = _ctx(QWEN3, tools=True)
    whole = _whole(text, ctx)
    assert whole.reasoning == f"I could call {CALL}." and whole.text == "Sure."
    assert [(t.name, json.loads(t.arguments)) for t in whole.tool_calls] == [
        ("weather", {"city": "Oslo"})
    ]
    assert whole.finish_reason == llm_pb2.FINISH_REASON_TOOL_CALLS
    streamed = _streamed(text, ctx, size)
    assert "".join(c.reasoning for c in streamed) == whole.reasoning
    assert "".join(c.text for c in streamed) == "Sure."
    assert [t.name for c in streamed for t in c.tool_calls] == ["weather"]
    assert streamed[-1].finish_reason == llm_pb2.FINISH_REASON_TOOL_CALLS


def test_without_a_parser_a_call_in_think_tags_is_read() -> None:
    # Parser off: the output is the answer as written, so the tool reader sees every call.
    c = _whole(f"<think>x</think>{CALL}", _ctx(None, tools=True))
    assert c.text == "<think>x</think>" and c.reasoning == ""
    assert [t.name for t in c.tool_calls] == ["weather"]
