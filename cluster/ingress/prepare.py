"""One generation request prepared for the engine, the same way for HTTP and gRPC.

Each ingress reads its request (an OpenAI body, a kvray.v1 GenerateRequest) as a `Source`:
only it knows where each field is and what its prompt looks like. `Preparer.prepare` then
runs the steps every generation request takes, in this order, each once:

1. the prompt's own checks (sizes, shapes), by the source -> `PromptInput`
2. sampling fields, read by the source
3. tool use: the tools and tool_choice, parsed once
4. the output constraint: the request's own or its tool calls' (both is an error), parsed once
5. SamplingParams with that constraint, within the deployment's `RequestLimits`
6. compile checks: every tool's parameter schema, and the constraint
7. token ids (text tokenized; chat rendered by the template, which lists the tools), checked
   against the served model into the engine's inputs: the final ones, under the adapter the
   request's `model` names and for its tenant (nothing downstream changes them)
8. a chat's reasoning (with a reasoning parser on, cluster/ingress/output_parsing.py): where
   its output starts, and a constraint made to wait for the reasoning's end

A failure is an InvalidRequestError naming the field as the client wrote it (HTTP 400, gRPC
INVALID_ARGUMENT), raised before anything is routed. The result (`Prepared`) carries the
parsed tool use and constraint along, so nothing downstream (the answer's tool-call reader)
parses them again; `Prepared.requests` gives the GenerateRequests to route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from cluster.errors import InvalidRequestError
from cluster.ingress import checks, structured
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from cluster.ingress.output_parsing import OutputParsing, Reasoning
from cluster.ingress.prompts import Prompts
from cluster.ingress.structured import Constraint
from cluster.ingress.tools import ToolUse
from cluster.messages import GenerateRequest
from workers.inputs import EngineInput
from workers.sampling_params import SamplingParams
from workers.structured.thinking import ThinkingBudget

if TYPE_CHECKING:
    from workers.inputs import InputChecker
    from workers.lora.request import LoRARequest


@dataclass(frozen=True)
class PromptInput:
    """A request's prompt after its ingress's own checks: a batch of texts and token-id lists,
    or one chat (template messages)."""

    field: str  # what tokenizing and template errors name ("prompt", "messages", "chat")
    batch: tuple[str | Sequence[int], ...] = ()
    chat: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    checked_as: str = "prompt"  # what the engine's input check names (HTTP chat: "messages")
    # Extra variables for the chat template (`chat_template_kwargs`, e.g. enable_thinking).
    template_kwargs: dict[str, Any] | None = None
    # Tokens the model may think before `</think>` is forced (None: unbounded), and the field
    # that set it: a budget without a reasoning parser is an error naming that field, or
    # ignored when None (Anthropic's budget_tokens, which clients send whatever the server).
    thinking_budget: int | None = None
    budget_field: str | None = None


class Source(Protocol):
    """A generation request as its ingress reads it; `prepare` calls each method once."""

    @property
    def stream(self) -> bool:
        """Whether the answer streams (the engine then yields deltas)."""
        ...

    @property
    def tools_field(self) -> str:
        """Where the request holds its tools: what the tool calls' constraint names."""
        ...

    def parameters_field(self, index: int) -> str:
        """Where the tool at `index` holds its parameter schema."""
        ...

    @property
    def priority(self) -> int:
        """The engine's queue priority: lower is more urgent (vLLM's extra field)."""
        ...

    def prompt_input(self, limits: RequestLimits) -> PromptInput: ...

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments, the output constraint aside."""
        ...

    def tool_use(self) -> ToolUse | None: ...

    def own_constraint(self) -> Constraint | None:
        """The request's own output constraint, not its tool calls'."""
        ...


@dataclass(frozen=True)
class Outputs:
    """What a request asks of its output, each parsed once: its tool use (None without
    tools), its output constraint (None: unconstrained) and, for a chat with a reasoning parser
    on, where its reasoning is (None: no reasoning is read)."""

    tool_use: ToolUse | None
    constraint: Constraint | None
    reasoning: Reasoning | None = None


@dataclass(frozen=True)
class Prepared:
    """A generation request checked into the engine's types, one input per prompt."""

    params: SamplingParams
    inputs: tuple[EngineInput, ...]
    outputs: Outputs

    @property
    def tool_use(self) -> ToolUse | None:
        return self.outputs.tool_use

    @property
    def constraint(self) -> Constraint | None:
        return self.outputs.constraint

    def requests(self, request_id: str) -> list[GenerateRequest]:
        """The engine requests, one per prompt: `request_id`, or `request_id-i` for several."""
        if len(self.inputs) == 1:
            return [GenerateRequest(request_id, self.inputs[0])]
        return [GenerateRequest(f"{request_id}-{i}", inp) for i, inp in enumerate(self.inputs)]


def read_outputs(source: Source, tool_format: str | None = None) -> Outputs:
    """The source's tool use and output constraint (steps 3 and 4), each parsed once;
    `tool_format`: how the model writes calls (the deployment's, which forced calls keep;
    None: not known, forced calls are the JSON array every format reads)."""
    use = source.tool_use()
    if use is not None and use.format != tool_format:
        use = replace(use, format=tool_format)
    own = source.own_constraint()
    calls = use.constraint(source.tools_field) if use is not None else None
    return Outputs(use, structured.only_one([c for c in (own, calls) if c is not None]))


def read_sampling(
    source: Source, limits: RequestLimits = DEFAULT_LIMITS, tool_format: str | None = None
) -> tuple[SamplingParams, Outputs]:
    """Steps 2 to 5: the SamplingParams, and the tool use and constraint they hold."""
    kwargs = source.sampling_kwargs()
    outputs = read_outputs(source, tool_format)
    if outputs.constraint is not None:
        kwargs["structured_outputs"] = outputs.constraint.spec
    return checks.sampling_params(kwargs, stream=source.stream, limits=limits), outputs


def sampling_params(source: Source, limits: RequestLimits = DEFAULT_LIMITS) -> SamplingParams:
    """The source's SamplingParams alone (as `prepare` builds them)."""
    return read_sampling(source, limits)[0]


class InputCheckers(Protocol):
    """Where the served model's InputChecker comes from (LLMClient)."""

    async def input_checker(self) -> InputChecker: ...


# Tool-call formats whose markers are special tokens (kept in the text when a request's
# output is read for calls, as vLLM does).
SPECIAL_TOKEN_FORMATS = frozenset({"mistral"})


class Preparer:
    """The shared preparation of one ingress replica: its tokenizer, the served model's
    input checker (`client`: LLMClient) and the deployment's request limits."""

    def __init__(
        self,
        prompts: Prompts,
        client: InputCheckers,
        limits: RequestLimits = DEFAULT_LIMITS,
        parsing: OutputParsing | None = None,
    ) -> None:
        self.prompts = prompts
        self.client = client
        self.limits = limits
        self.parsing = parsing or OutputParsing()

    async def prepare(
        self, source: Source, *, lora: LoRARequest | None = None, tenant: str | None = None
    ) -> Prepared:
        """The request checked into the engine's inputs (module doc), under the adapter `lora`
        (None: the base model) and for `tenant` (who sent it); errors name the field."""
        prompt = source.prompt_input(self.limits)
        params, outputs = read_sampling(source, self.limits, self.parsing.tool_format)
        await self.check_compiles(outputs, source)
        token_ids = await self.token_ids(prompt, outputs.tool_use)
        params, outputs = self.read_answer(prompt, token_ids, params, outputs)
        checker = await self.client.input_checker()
        inputs = checks.engine_inputs(
            checker,
            token_ids,
            params,
            prompt.checked_as,
            source.priority,
            lora=lora,
            tenant=tenant,
        )
        return Prepared(params, inputs, outputs)

    def read_answer(
        self,
        prompt: PromptInput,
        token_ids: list[list[int]],
        params: SamplingParams,
        outputs: Outputs,
    ) -> tuple[SamplingParams, Outputs]:
        """Step 8, and special tokens kept for a format that needs them: a chat's reasoning
        is read from its prompt, and when its output starts inside the reasoning, its
        constraint waits for the reasoning's end (the grammar shapes the answer, not the
        thinking)."""
        use = outputs.tool_use
        if use is not None and use.parses and use.format in SPECIAL_TOKEN_FORMATS:
            # Mistral's [TOOL_CALLS] is a special token: the text must keep it to be read.
            params = replace(params, skip_special_tokens=False)
        reasoning = None if prompt.chat is None else self.parsing.reasoning_for(token_ids[0])
        if reasoning is None:
            if prompt.thinking_budget is not None and prompt.budget_field is not None:
                raise InvalidRequestError(
                    prompt.budget_field,
                    f"{prompt.budget_field} needs a chat request and a server started with "
                    "--reasoning-parser",
                )
            return params, outputs
        spec = params.structured_outputs
        # Only an output that starts inside the reasoning waits for its end. One that may open
        # a block (Qwen3's own <think>) is constrained at once: a grammar waiting for a block
        # the model never opens would leave the answer unconstrained.
        if spec is not None and reasoning.inside:
            params = replace(params, structured_outputs=spec.starting_after(self.parsing.end_ids))
        budget = prompt.thinking_budget
        # A budget counts the thinking: from the output's start when it starts inside, from
        # the model's own <think> when it may open one (and no grammar forbids it).
        if budget is not None and (reasoning.inside or (reasoning.may_open and spec is None)):
            thinking = ThinkingBudget(
                budget, self.parsing.end_ids, self.parsing.start_ids, reasoning.inside
            )
            params = replace(params, thinking_budget=thinking)
        return params, replace(outputs, reasoning=reasoning)

    async def check_compiles(self, outputs: Outputs, source: Source) -> None:
        """Every tool's parameter schema compiles (whatever tool_choice is, so a bad schema
        is an error naming its tool), and so does the output constraint."""
        tokenizer = self.prompts.tokenizer
        if outputs.tool_use is not None:
            for c in outputs.tool_use.parameter_constraints(source.parameters_field):
                await structured.check(c, tokenizer)
        await structured.check(outputs.constraint, tokenizer)

    async def token_ids(self, prompt: PromptInput, tool_use: ToolUse | None) -> list[list[int]]:
        """The prompt's token ids, one list per prompt; a chat lists the tools to the model."""
        if prompt.chat is None:
            return await self.prompts.batch(prompt.batch, prompt.field)
        tools = tool_use.template_tools() if tool_use is not None else None
        ids = await self.prompts.chat(
            prompt.chat,
            prompt.add_generation_prompt,
            field=prompt.field,
            tools=tools,
            template_kwargs=prompt.template_kwargs,
        )
        return [ids]
