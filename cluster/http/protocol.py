"""OpenAI request bodies (pydantic) and their translation into the engine's SamplingParams.

Only requests are modelled: responses are plain dicts built in cluster/http/format.py, which
is cheaper per streamed chunk. Unknown body fields are ignored (clients send `user`,
`service_tier`, ...); known fields with bad values are rejected naming the field. vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
skip_special_tokens, include_stop_str_in_output, prompt_logprobs) and `priority` are accepted
because clients already send them; completions' `echo` (and `max_tokens: 0` with it) is answered by
cluster/http/echo.py.
Output constraints (`response_format`, vLLM's `structured_outputs` and `guided_*`) and chat
tools are read by cluster/ingress/structured.py and cluster/ingress/tools.py, shared with gRPC.
`chat_template_kwargs` (vLLM's: extra variables for the chat template, e.g. Qwen3's
`enable_thinking`) is checked by `template_kwargs`, shared with /v1/responses.
Each body is a `cluster.ingress.prepare.Source`: the shared preparation reads it, each part
once, into the engine's inputs.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from cluster.errors import InvalidRequestError
from cluster.ingress import prepare, structured, tools
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from cluster.ingress.prepare import PromptInput
from workers.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams

# JSON numbers and booleans only: in pydantic's lax mode `false` passed as 0, "1.5" as 1.5
# and 1 as true, where the API's schema (and OpenAI's) says otherwise (the fuzz tests send them).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict floats still take JSON integers
Bool = Annotated[bool, Strict()]  # not 0/1 or "true"


def template_kwargs(value: Any, field: str = "chat_template_kwargs") -> dict[str, Any] | None:
    """A request's chat template variables: an object with string keys (None: unset). Which
    names the template's caller sets itself is checked where the template runs
    (cluster/ingress/prompts.py)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidRequestError(field, f"{field} must be an object with string keys")
    return dict(value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")
    # Where a chat holds its tools (what the tool calls' constraint names).
    tools_field: ClassVar[str] = "tools"

    model: str | None = None
    n: Int = 1
    temperature: Float | None = None
    top_p: Float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    # vLLM's: the engine's queue priority, lower is more urgent (docs/serving.md).
    priority: Int = 0
    # vLLM's: the log-probabilities of the prompt's tokens, each with the top N at its
    # position (non-streamed answers only, as vLLM; docs/scoring.md).
    prompt_logprobs: Int | None = None
    # Output constraints: OpenAI's, vLLM's, and vLLM's older names (at most one is set).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def sampling_params(self, limits: RequestLimits = DEFAULT_LIMITS) -> SamplingParams:
        """The engine's SamplingParams, validated, with the output kind `stream` needs and
        the output constraint; an unsupported or bad value, or one over `limits`, raises
        InvalidRequestError naming the field. (The ingress gets them from `prepare`.)"""
        return prepare.sampling_params(self, limits)

    def constraint(self) -> structured.Constraint | None:
        """The output constraint and the field it came from (None: unconstrained)."""
        return prepare.read_outputs(self).constraint

    # -- cluster.ingress.prepare.Source -------------------------------------------------

    def prompt_input(self, limits: RequestLimits) -> PromptInput:
        raise NotImplementedError

    def sampling_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def tool_use(self) -> tools.ToolUse | None:
        return None

    def parameters_field(self, index: int) -> str:
        return f"tools[{index}].function.parameters"

    def own_constraint(self) -> structured.Constraint | None:
        """The request's own output constraint: response_format, structured_outputs or a
        guided_* field."""
        guided = {name: getattr(self, name) for name in structured.GUIDED_FIELDS}
        return structured.from_openai(self.response_format, self.structured_outputs, guided)

    def common_params(self) -> dict[str, Any]:
        if self.logit_bias:
            raise InvalidRequestError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "stream_options needs stream=true")
        params: dict[str, Any] = {
            "prompt_logprobs": self._engine_prompt_logprobs(),
            "n": self.n,
            "seed": self.seed,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _engine_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs` as the engine computes it: None when not asked, or when a stream
        asks for 0 (accepted, like vLLM, but a stream never shows them). Its range is checked
        by SamplingParams, as every API's is."""
        n = self.prompt_logprobs
        if n is None or (self.stream and n == 0):
            return None
        if self.stream and n > 0:  # vLLM refuses them too: they would come only with the last chunk
            raise InvalidRequestError(
                "prompt_logprobs", "prompt_logprobs is not available with stream=true"
            )
        return n

    @property
    def answered_prompt_logprobs(self) -> int | None:
        """The top-N of vLLM's `prompt_logprobs` answer field (None: not in the answer), of a
        request prepared already (which checked the field)."""
        return None if self.stream else self.prompt_logprobs


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = DEFAULT_MAX_TOKENS
    logprobs: Int | None = None
    echo: Bool = False
    best_of: Int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    def prompt_input(self, limits: RequestLimits) -> PromptInput:
        batch = self.prompts()
        limits.check_prompts(len(batch))
        return PromptInput("prompt", batch=tuple(batch))

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, one token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def scoring_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt and its logprobs, no completion."""
        return self.echo and self.max_tokens == 0

    def sampling_kwargs(self) -> dict[str, Any]:
        if self.suffix:
            raise InvalidRequestError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of", "best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens", "max_tokens must be >= 1 (0 scores the prompt only, with echo=true)"
            )
        params = self.common_params()
        # Scoring only: the engine computes the prompt (it always samples at least one token,
        # which the answer leaves out), as vLLM does.
        params["max_tokens"] = 1 if self.scoring_only else self.max_tokens
        params["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None:
            # The echoed prompt's tokens carry logprobs like the completion's: enough for both
            # views. A value out of range stays, for SamplingParams' range checks to name.
            asked = params["prompt_logprobs"]
            if asked is None or 0 <= asked < self.logprobs:
                params["prompt_logprobs"] = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError("messages", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = tools.template_tool_calls(self.tool_calls, "messages")
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables
    # vLLM's: tokens of thinking before `</think>` is forced (needs a reasoning parser).
    thinking_token_budget: Int | None = Field(default=None, ge=0)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]

    def prompt_input(self, limits: RequestLimits) -> PromptInput:
        # The rendered messages are the prompt: the engine's input check names "messages".
        limits.check_messages(len(self.messages))
        return PromptInput(
            "messages",
            chat=self.template_messages(),
            add_generation_prompt=self.add_generation_prompt,
            checked_as="messages",
            template_kwargs=template_kwargs(self.chat_template_kwargs),
            thinking_budget=self.thinking_token_budget,
            budget_field="thinking_token_budget",
        )

    def tool_use(self) -> tools.ToolUse | None:
        """The checked tools and tool_choice (None when the request has no tools); the
        output constraint is the tool calls' with tool_choice "required" or a named
        function (`constraint`; with the request's own as well, an error naming both)."""
        return tools.tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_kwargs(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs=true")
        params = self.common_params()
        limit = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        params["max_tokens"] = limit
        params["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return params


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Bool = True
    tools: list[Any] | None = None  # listed by the chat template, as for a chat request
    chat_template_kwargs: dict[str, Any] | None = None  # as for a chat request

    def template_tools(self) -> list[dict[str, Any]] | None:
        use = tools.tool_use(self.tools, None, None)
        return use.template_tools() if use is not None else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Int]
