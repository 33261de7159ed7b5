"""The deployment's output parsing resolved per ingress (cluster/ingress/output_parsing.py),
and what the Preparer makes of it: the tool format on every request's tool use, a chat's
reasoning read from its prompt, and a constraint made to wait for the reasoning's end."""

from __future__ import annotations

import asyncio

import pytest

from cluster.config.parsing import ParsingSettings
from cluster.errors import InvalidRequestError
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.output_parsing import MARKER_WINDOW, OutputParsing, Reasoning
from cluster.ingress.prepare import Preparer
from cluster.ingress.prompts import Prompts
from tests.cluster.ingress.test_prepare import TOOLS, USER, FakeClient
from workers.structured.thinking import ThinkingBudget


def _chars(text: str) -> list[int]:
    """A tokenizer where every character is a token: markers are several ids long."""
    return [ord(c) for c in text]


def _parsing(reasoning: str | None = "qwen3", tool: str = "auto", template=None):
    return OutputParsing.resolve(ParsingSettings(tool, reasoning), template, _chars)


def test_off_reads_no_reasoning() -> None:
    parsing = _parsing(None)
    assert parsing.reasoning is None and parsing.end_ids == ()
    assert parsing.reasoning_for(_chars("<think>")) is None


@pytest.mark.parametrize(
    ("parser", "prompt", "want"),
    [
        # Qwen3 writes its own <think>: the output starts in the answer, and may open one.
        ("qwen3", "user: hi\nassistant:", Reasoning("qwen3", inside=False, may_open=True)),
        # DeepSeek-R1's models may leave the opening tag out: the output starts inside.
        ("deepseek_r1", "user: hi\nassistant:", Reasoning("deepseek_r1", inside=True)),
        # A template that opened the block (R1, newer Qwen3) starts the output inside it.
        ("qwen3", "assistant:<think>\n", Reasoning("qwen3", inside=True)),
        # Thinking switched off: the template closed an empty block; all is answer.
        ("qwen3", "assistant:<think>\n\n</think>\n\n", Reasoning("qwen3", inside=False)),
        ("deepseek_r1", "a:<think>x</think>b", Reasoning("deepseek_r1", inside=False)),
        # An earlier turn's closed block does not matter: the last marker decides.
        ("qwen3", "<think>a</think>ok\nassistant:<think>", Reasoning("qwen3", inside=True)),
    ],
)
def test_the_prompts_last_marker_decides_where_the_output_starts(
    parser: str, prompt: str, want: Reasoning
) -> None:
    assert _parsing(parser).reasoning_for(_chars(prompt)) == want


def test_markers_are_looked_for_near_the_prompts_end_only() -> None:
    prompt = _chars("<think>") + [0] * MARKER_WINDOW
    assert _parsing("qwen3").reasoning_for(prompt) == Reasoning("qwen3", False, may_open=True)


@pytest.mark.parametrize(
    ("template", "want"),
    [(None, "hermes"), ("{{ '<tool_call>' }}", "hermes"), ("{{ '[TOOL_CALLS]' }}", "mistral")],
)
def test_auto_reads_the_template(template: str | None, want: str) -> None:
    assert _parsing(None, "auto", template).tool_format == want
    assert _parsing(None, "pythonic", template).tool_format == "pythonic"


# -- the Preparer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> Prompts:
    from workers.demo import demo_model_dir
    from workers.tokenizer import Tokenizer

    return Prompts(Tokenizer.from_pretrained(demo_model_dir()))


def _prepare(prompts: Prompts, parsing: OutputParsing, body):
    preparer = Preparer(prompts, FakeClient(prompts.vocab_size), DEFAULT_LIMITS, parsing)
    return asyncio.run(preparer.prepare(body))


def _of(prompts: Prompts, reasoning: str | None, tool: str = "auto") -> OutputParsing:
    return OutputParsing.of(ParsingSettings(tool, reasoning), prompts.tokenizer)


def test_the_tool_format_reaches_every_tool_use(prompts: Prompts) -> None:
    body = ChatCompletionRequest(messages=USER, tools=TOOLS)
    prepared = _prepare(prompts, _of(prompts, None, "llama3_json"), body)
    assert prepared.tool_use is not None and prepared.tool_use.format == "llama3_json"
    # The demo model's template writes <tool_call> blocks: auto reads hermes from it.
    assert _prepare(prompts, _of(prompts, None), body).tool_use.format == "hermes"


def test_mistral_calls_keep_special_tokens_in_the_text(prompts: Prompts) -> None:
    body = ChatCompletionRequest(messages=USER, tools=TOOLS)
    assert (
        _prepare(prompts, _of(prompts, None, "mistral"), body).params.skip_special_tokens is False
    )
    # Without calls to read (no tools, or tool_choice none), the text is as before.
    plain = ChatCompletionRequest(messages=USER)
    assert _prepare(prompts, _of(prompts, None, "mistral"), plain).params.skip_special_tokens
    none = ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="none")
    assert _prepare(prompts, _of(prompts, None, "mistral"), none).params.skip_special_tokens
    assert _prepare(prompts, _of(prompts, None, "hermes"), body).params.skip_special_tokens


def test_a_constraint_waits_for_the_reasoning_to_end(prompts: Prompts) -> None:
    parsing = _of(prompts, "deepseek_r1")
    assert parsing.end_ids == tuple(prompts.tokenizer.encode("</think>", add_special_tokens=False))
    body = ChatCompletionRequest(messages=USER, response_format={"type": "json_object"})
    prepared = _prepare(prompts, parsing, body)
    assert prepared.outputs.reasoning == Reasoning("deepseek_r1", inside=True)
    assert prepared.params.structured_outputs.after == parsing.end_ids
    # Off, the same request's constraint applies from the first token.
    plain = _prepare(prompts, _of(prompts, None), body)
    assert plain.outputs.reasoning is None and plain.params.structured_outputs.after is None


def test_a_thinking_prompt_waits_and_one_that_may_think_does_not(prompts: Prompts) -> None:
    body = ChatCompletionRequest(messages=USER, response_format={"type": "json_object"})
    # The demo template opens <think> in the generation prompt when asked to.
    thinking = body.model_copy(update={"chat_template_kwargs": {"enable_thinking": True}})
    parsing = _of(prompts, "qwen3")
    prepared = _prepare(prompts, parsing, thinking)
    assert prepared.outputs.reasoning == Reasoning("qwen3", inside=True)
    assert prepared.params.structured_outputs.after == parsing.end_ids
    # Qwen3's own <think> may open the output: the grammar applies at once (the model then
    # answers without thinking) rather than wait for a block it may never open.
    prepared = _prepare(prompts, parsing, body)
    assert prepared.outputs.reasoning == Reasoning("qwen3", inside=False, may_open=True)
    assert prepared.params.structured_outputs.after is None


def test_a_prompt_that_closed_the_reasoning_constrains_at_once(prompts: Prompts) -> None:
    closed = [*USER, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    body = ChatCompletionRequest(
        messages=closed,
        response_format={"type": "json_object"},
        add_generation_prompt=False,
    )
    prepared = _prepare(prompts, _of(prompts, "qwen3"), body)
    assert prepared.outputs.reasoning == Reasoning("qwen3", inside=False)
    assert prepared.params.structured_outputs.after is None


def test_completions_read_no_reasoning(prompts: Prompts) -> None:
    body = CompletionRequest(prompt="<think>", max_tokens=4)
    assert _prepare(prompts, _of(prompts, "qwen3"), body).outputs.reasoning is None


# -- thinking budgets -----------------------------------------------------------------------


THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


def test_a_budget_counts_from_where_the_thinking_starts(prompts: Prompts) -> None:
    parsing = _of(prompts, "qwen3")
    inside = ChatCompletionRequest(messages=USER, thinking_token_budget=6, **THINKING)
    want = ThinkingBudget(6, parsing.end_ids, parsing.start_ids, inside=True)
    assert _prepare(prompts, parsing, inside).params.thinking_budget == want
    # Qwen3 may open its own block: counting starts at its <think>.
    may_open = ChatCompletionRequest(messages=USER, thinking_token_budget=6)
    got = _prepare(prompts, parsing, may_open).params.thinking_budget
    assert got == ThinkingBudget(6, parsing.end_ids, parsing.start_ids, inside=False)
    # ...unless a grammar applies from the first token: then there is no thinking to bound.
    constrained = may_open.model_copy(update={"response_format": {"type": "json_object"}})
    assert _prepare(prompts, parsing, constrained).params.thinking_budget is None


def test_a_budget_without_a_reasoning_parser_is_a_400(prompts: Prompts) -> None:
    body = ChatCompletionRequest(messages=USER, thinking_token_budget=6)
    with pytest.raises(InvalidRequestError) as err:
        _prepare(prompts, _of(prompts, None), body)
    assert err.value.field == "thinking_token_budget"


def test_anthropic_budget_tokens_are_enforced_only_with_a_parser(prompts: Prompts) -> None:
    from cluster.http.messages import MessagesRequest

    body = MessagesRequest(
        messages=USER, max_tokens=32, thinking={"type": "enabled", "budget_tokens": 5}
    )
    assert _prepare(prompts, _of(prompts, None), body).params.thinking_budget is None
    parsing = _of(prompts, "deepseek_r1")
    got = _prepare(prompts, parsing, body).params.thinking_budget
    assert got is not None and (got.budget, got.inside) == (5, True)
