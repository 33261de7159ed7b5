"""Small Python clients for kvray's gRPC API (kvray.v1.LLMService), sync and asyncio.

    with KvrayClient("127.0.0.1:9000", api_key="...") as client:
        reply = client.generate("The capital of France is", max_tokens=8, temperature=0)
        print(completion_text(reply), reply.usage.completion_tokens)
        for piece in client.generate_stream("Once upon a time", max_tokens=32):
            print(completion_text(piece), end="", flush=True)
        vectors = embedding_vectors(client.embed(["first text", "second text"]))

Both clients return the stubs' messages (kvray.v1.llm_pb2) unchanged, so every field of the
.proto is reachable; `completion_text` is the shortcut for the common case.
Leaving a `generate_stream` loop early (break, exception, task cancellation) cancels the
RPC, which aborts the request on the server and frees its KV cache.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
import grpc.aio

from kvray.v1 import llm_pb2, llm_pb2_grpc

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]

# Keyword arguments accepted as sampling options: exactly the SamplingParams message's fields.
SAMPLING_FIELDS = frozenset(f.name for f in llm_pb2.SamplingParams.DESCRIPTOR.fields)


def build_generate_request(
    prompt: Prompt | None = None,
    *,
    messages: Messages | None = None,
    model: str = "",
    request_id: str = "",
    top_logprobs: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    prompt_logprobs: int | None = None,
    priority: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    thinking_token_budget: int | None = None,
    **sampling: Any,
) -> llm_pb2.GenerateRequest:
    """A GenerateRequest from Python values.

    Give exactly one of `prompt` (text, or token ids) and `messages` (chat, as dicts with
    role and content, and OpenAI-style tool_calls / tool_call_id). `sampling` holds
    SamplingParams fields by name (max_tokens=16, temperature=0.0, stop=["\\n"], ...; an
    output constraint as json_schema=<dict or JSON text>, regex=..., choice=[...],
    grammar=..., json_object=True); `top_logprobs` (0-20) asks for log probabilities, and
    `prompt_logprobs` (0-20 alternatives) for the prompt tokens' (response.prompt_logprobs).
    `tools` (OpenAI tool dicts), `tool_choice` ("auto", "none", "required", or a function
    name as {"name": ...} or OpenAI's {"type": "function", "function": {"name": ...}}) and
    `parallel_tool_calls` go with `messages`, as do `chat_template_kwargs` (extra template
    variables, e.g. {"enable_thinking": False}) and `thinking_token_budget` (tokens of thinking
    before `</think>` is forced; needs a server with --reasoning-parser). `priority`: the queue
    priority, lower is more urgent.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling option(s): {', '.join(unknown)}")
    req = llm_pb2.GenerateRequest(model=model, request_id=request_id, priority=priority)
    chat_only = (tool_choice, parallel_tool_calls, chat_template_kwargs, thinking_token_budget)
    if messages is not None:
        req.chat.CopyFrom(chat_messages(messages, tools, tool_choice, parallel_tool_calls))
        if chat_template_kwargs is not None:  # unset ("") is no variables
            req.chat.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
        if thinking_token_budget is not None:
            req.chat.thinking_token_budget = thinking_token_budget
    elif tools or any(x is not None for x in chat_only):
        raise ValueError(
            "tools, tool_choice, parallel_tool_calls, chat_template_kwargs and "
            "thinking_token_budget need messages"
        )
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if isinstance(sampling.get("json_schema"), (Mapping, bool)):
        sampling["json_schema"] = json.dumps(sampling["json_schema"])
    if isinstance(sampling.get("choice"), (list, tuple)):
        sampling["choice"] = llm_pb2.Choices(values=sampling["choice"])
    req.sampling.CopyFrom(llm_pb2.SamplingParams(**sampling))
    if top_logprobs is not None:
        req.logprobs.top_logprobs = top_logprobs
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
    return req


def chat_messages(
    messages: Messages,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> llm_pb2.ChatMessages:
    chat = llm_pb2.ChatMessages(messages=[_message(m) for m in messages])
    for t in tools or ():
        fn = t.get("function", t)  # OpenAI's {"type": "function", "function": {...}} or bare
        params = fn.get("parameters")
        chat.tools.add(
            name=fn["name"],
            description=fn.get("description") or "",
            parameters_json=json.dumps(params) if params is not None else "",
        )
    if isinstance(tool_choice, str):
        chat.tool_choice.mode = _TOOL_MODES[tool_choice]
    elif tool_choice is not None:
        fn = tool_choice.get("function", tool_choice)
        chat.tool_choice.function_name = fn["name"]
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    return chat


_TOOL_MODES = {
    "auto": llm_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": llm_pb2.TOOL_CHOICE_MODE_NONE,
    "required": llm_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def _message(m: Mapping[str, Any]) -> llm_pb2.ChatMessage:
    msg = llm_pb2.ChatMessage(role=m["role"], content=m.get("content") or "")
    for call in m.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        msg.tool_calls.add(
            id=call.get("id", ""),
            name=fn["name"],
            arguments=args if isinstance(args, str) else json.dumps(args),
        )
    if m.get("tool_call_id"):
        msg.tool_call_id = m["tool_call_id"]
    return msg


def build_embed_request(
    inputs: Prompt | Sequence[Prompt],
    *,
    model: str = "",
    request_id: str = "",
    pooling_type: str | None = None,
    normalize: bool | None = None,
    truncate_prompt_tokens: int | None = None,
) -> llm_pb2.EmbedRequest:
    """An EmbedRequest: `inputs` is one text, one list of token ids, or a list of either;
    `pooling_type` "last" (unset) or "mean"."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]  # type: ignore[list-item]
    req = llm_pb2.EmbedRequest(model=model, request_id=request_id)
    for one in inputs:
        if isinstance(one, str):
            req.inputs.add(text=one)
        else:
            req.inputs.add(token_ids=llm_pb2.TokenIds(ids=one))  # type: ignore[arg-type]
    if pooling_type is not None:
        if pooling_type.lower() not in _POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of last, mean, got {pooling_type!r}")
        req.pooling_type = _POOLING_TYPES[pooling_type.lower()]
    if normalize is not None:
        req.normalize = normalize
    if truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = truncate_prompt_tokens
    return req


_POOLING_TYPES = {"last": llm_pb2.POOLING_TYPE_LAST, "mean": llm_pb2.POOLING_TYPE_MEAN}


def embedding_vectors(response: llm_pb2.EmbedResponse) -> list[list[float]]:
    """The vectors of an Embed response, in input order."""
    return [list(e.values) for e in sorted(response.embeddings, key=lambda e: e.index)]


def build_tokenize_request(
    text: str | None = None, *, messages: Messages | None = None, model: str = ""
) -> llm_pb2.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text and messages")
    if messages is not None:
        return llm_pb2.TokenizeRequest(model=model, chat=chat_messages(messages))
    return llm_pb2.TokenizeRequest(model=model, text=text)


def completion_text(response: llm_pb2.GenerateResponse, index: int = 0) -> str:
    """The text of completion `index` of a Generate response ("" if it has none)."""
    for c in response.completions:
        if c.index == index:
            return c.text
    return ""


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class KvrayClient:
    """Blocking client. `target` is "host:port"; `timeout` (seconds) is the default deadline."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = llm_pb2_grpc.LLMServiceStub(self._channel)
        self._metadata = _metadata(api_key)
        self._timeout = timeout

    def generate(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> llm_pb2.GenerateResponse:
        """The finished completion(s). kwargs: see build_generate_request."""
        req = build_generate_request(prompt, **kwargs)
        return self._stub.Generate(req, timeout=self._deadline(timeout), metadata=self._metadata)

    def generate_stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[llm_pb2.GenerateResponse]:
        """Deltas as they are produced; the last carries finish_reason and usage."""
        req = build_generate_request(prompt, **kwargs)
        call = self._stub.GenerateStream(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended; aborts the request otherwise

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Messages | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> list[int]:
        req = build_tokenize_request(text, messages=messages, model=model)
        resp = self._stub.Tokenize(req, timeout=self._deadline(timeout), metadata=self._metadata)
        return list(resp.token_ids)

    def list_models(self, *, timeout: float | None = None) -> list[llm_pb2.Model]:
        resp = self._stub.ListModels(
            llm_pb2.ListModelsRequest(), timeout=self._deadline(timeout), metadata=self._metadata
        )
        return list(resp.models)

    def embed(
        self, inputs: Prompt | Sequence[Prompt], *, timeout: float | None = None, **kwargs: Any
    ) -> llm_pb2.EmbedResponse:
        """One embedding per input (`embedding_vectors` lists them). kwargs: see
        build_embed_request."""
        req = build_embed_request(inputs, **kwargs)
        return self._stub.Embed(req, timeout=self._deadline(timeout), metadata=self._metadata)

    def load_lora_adapter(
        self, name: str, path: str, *, timeout: float | None = None
    ) -> llm_pb2.Model:
        """Serves the LoRA adapter in directory `path` (on the server) as model `name`."""
        req = llm_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        resp = self._stub.LoadLoraAdapter(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )
        return resp.model

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        req = llm_pb2.UnloadLoraAdapterRequest(lora_name=name)
        self._stub.UnloadLoraAdapter(req, timeout=self._deadline(timeout), metadata=self._metadata)

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self._timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KvrayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKvrayClient:
    """asyncio twin of KvrayClient; create and use it inside one running event loop."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=options)
        )
        self._stub = llm_pb2_grpc.LLMServiceStub(self._channel)
        self._metadata = _metadata(api_key)
        self._timeout = timeout

    async def generate(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> llm_pb2.GenerateResponse:
        req = build_generate_request(prompt, **kwargs)
        return await self._stub.Generate(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )

    async def generate_stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[llm_pb2.GenerateResponse]:
        req = build_generate_request(prompt, **kwargs)
        call = self._stub.GenerateStream(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )
        try:
            async for resp in call:
                yield resp
        finally:
            call.cancel()

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Messages | None = None,
        model: str = "",
        timeout: float | None = None,
    ) -> list[int]:
        req = build_tokenize_request(text, messages=messages, model=model)
        resp = await self._stub.Tokenize(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )
        return list(resp.token_ids)

    async def list_models(self, *, timeout: float | None = None) -> list[llm_pb2.Model]:
        resp = await self._stub.ListModels(
            llm_pb2.ListModelsRequest(), timeout=self._deadline(timeout), metadata=self._metadata
        )
        return list(resp.models)

    async def embed(
        self, inputs: Prompt | Sequence[Prompt], *, timeout: float | None = None, **kwargs: Any
    ) -> llm_pb2.EmbedResponse:
        req = build_embed_request(inputs, **kwargs)
        return await self._stub.Embed(req, timeout=self._deadline(timeout), metadata=self._metadata)

    async def load_lora_adapter(
        self, name: str, path: str, *, timeout: float | None = None
    ) -> llm_pb2.Model:
        req = llm_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        resp = await self._stub.LoadLoraAdapter(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )
        return resp.model

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        req = llm_pb2.UnloadLoraAdapterRequest(lora_name=name)
        await self._stub.UnloadLoraAdapter(
            req, timeout=self._deadline(timeout), metadata=self._metadata
        )

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self._timeout

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKvrayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
