"""kvray.v1.LLMService implemented over an LLMServer DeploymentHandle (grpc.aio).

Every RPC runs in one frame (`_rpc`) that checks the API key, bounds the call by the
client's deadline, maps errors to status codes and counts the outcome in
`kvray_router_requests_total{protocol="grpc"}`. Like the HTTP ingress, and with the same
code (cluster/ingress/prepare.py, reading the request through convert.GenerateSource), a
request is checked here into the engine's own types (prompt tokenized, chat through the
template, SamplingParams, tools and output constraint, token ids checked against the served
model) and sent to LLMServer as a GenerateRequest through the shared LLMClient, so the
prefix-affinity router and the engine see identical requests from both APIs, and errors
have the same status on both (cluster.errors.as_kvray_error). Embed reads its inputs with
the shared embedding preparation (cluster/ingress/embeddings.py), as POST /v1/embeddings does,
and runs one engine request per input, concurrently. `model` names the served model or one of
its LoRA adapters, resolved by the catalog both ingresses share (cluster/ingress/lora_catalog.py),
which LoadLoraAdapter and UnloadLoraAdapter change as the HTTP routes do.

Cancellation: grpc.aio cancels the handler task when the client cancels or disconnects; the
LLMClient stream is closed with it, which cancels the Serve call, which Ray Serve delivers to
the LLMServer replica as CancelledError, which aborts the engine request and frees its KV
blocks. Deadlines are enforced here as well (asyncio.timeout on the remaining time), so the
engine request is aborted at the deadline even before the transport notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

from cluster.config.replicas import DEFAULT_MAX_MIGRATIONS
from cluster.errors import InvalidRequestError, KvrayError, as_kvray_error
from cluster.grpc_api import constraints
from cluster.grpc_api import convert as conv
from cluster.ingress import embeddings
from cluster.ingress.auth import ApiKeyAuth
from cluster.ingress.gather import gather_or_cancel
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from cluster.ingress.llm_client import LLMClient
from cluster.ingress.lora_catalog import LoraCatalog
from cluster.ingress.lora_registry import Adapter
from cluster.ingress.output_parsing import OutputParsing
from cluster.ingress.prepare import Preparer
from cluster.ingress.prompts import Prompts
from cluster.ingress.tenant_gate import TenantGate
from cluster.ingress.tenants import bind_tenant, current_tenant
from cluster.ingress.token_text import TokenStrings
from cluster.messages import GenerateRequest
from kvray.v1 import llm_pb2, llm_pb2_grpc

if TYPE_CHECKING:
    from cluster.ingress.route_spans import RouteSpans
    from workers.outputs import RequestOutput

logger = logging.getLogger("kvray.grpc")

T = TypeVar("T")
OWNED_BY = "kvray"


def status_for(exc: BaseException, input_kind: str | None = None) -> tuple[grpc.StatusCode, str]:
    """The status code and details a failed RPC ends with: cluster.errors' one mapping, with
    an invalid field named where it is in the request the client sent."""
    err = as_kvray_error(exc)
    if isinstance(err, InvalidRequestError):
        path = conv.request_field_path(err.field, input_kind)
        return grpc.StatusCode.INVALID_ARGUMENT, f"{path}: {err.message}" if path else err.message
    return grpc.StatusCode[err.grpc_code], err.message


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    """The RPCs. `llm` is a DeploymentHandle to LLMServer."""

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        served_model: str,
        auth: ApiKeyAuth,
        metrics: Any = None,
        limits: RequestLimits = DEFAULT_LIMITS,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        queue_timeout_s: float | None = None,
        spans: RouteSpans | None = None,
        gate: TenantGate | None = None,
        lora: LoraCatalog | None = None,
        pd: dict[str, Any] | None = None,
        parsing: OutputParsing | None = None,
    ) -> None:
        # `tokenizer`: workers.tokenizer.Tokenizer of the served checkpoint.
        # `spans`: tracing's routing spans (cluster/ingress/route_spans.py); None: off.
        # `pd`: disaggregation's LLMClient keywords (cluster/ingress/pd.py); None: none.
        self._client = LLMClient(llm, max_migrations, metrics, queue_timeout_s, spans, **(pd or {}))
        # `parsing`: the tool-call format and reasoning parser (cluster/ingress/output_parsing.py).
        self._preparer = Preparer(Prompts(tokenizer), self._client, limits, parsing)
        # Tenants' quotas and metrics (cluster/ingress/tenant_gate.py); None: no quotas.
        self._gate = (gate or TenantGate()).serving(self._client)
        # Logprob token texts exactly as the HTTP API shows them (special tokens included).
        self._token_text = TokenStrings.of(tokenizer)
        self._auth = auth
        self._metrics = metrics  # cluster.routing.metrics.RouterMetrics, or None (unit use)
        self._limits = limits  # ServeConfig's request bounds, as the HTTP ingress applies them
        # What `model` names: the served model or a LoRA adapter (None: the model alone).
        self._lora = lora or LoraCatalog(served_model)

    # -- RPCs ------------------------------------------------------------------------------

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.GenerateResponse:
        async def body() -> llm_pb2.GenerateResponse:
            llm_req, ctx = await self._prepare(request, stream=False)
            return conv.final_response(await self._final(llm_req), ctx)

        return await self._rpc(context, body, conv.input_kind(request))

    async def GenerateStream(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        async def body() -> None:
            llm_req, ctx = await self._prepare(request, stream=True)
            state = conv.StreamState()
            outputs = self._gate.metered(self._client.generate(llm_req), llm_req)
            async with contextlib.aclosing(outputs) as outs:
                async for out in outs:
                    msg = conv.stream_response(out, state, ctx)
                    if msg is not None:
                        await context.write(msg)

        await self._rpc(context, body, conv.input_kind(request))

    async def Tokenize(
        self, request: llm_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.TokenizeResponse:
        async def body() -> llm_pb2.TokenizeResponse:
            await self._lora.target(request.model)  # an adapter tokenizes as its model
            prompt = conv.prompt_of(request, self._limits)
            use = constraints.tool_use(request.chat) if prompt.chat is not None else None
            (ids,) = await self._preparer.token_ids(prompt, use)
            card = await self.model_card()
            return llm_pb2.TokenizeResponse(
                token_ids=ids, count=len(ids), max_model_len=card["max_model_len"]
            )

        return await self._rpc(context, body, conv.input_kind(request))

    async def ListModels(
        self, request: llm_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.ListModelsResponse:
        async def body() -> llm_pb2.ListModelsResponse:
            models = [await self._model_message(None)]  # the base model, then its adapters
            models += [await self._model_message(a) for a in await self._lora.adapters()]
            return llm_pb2.ListModelsResponse(models=models)

        return await self._rpc(context, body)

    async def LoadLoraAdapter(
        self, request: llm_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.LoadLoraAdapterResponse:
        async def body() -> llm_pb2.LoadLoraAdapterResponse:
            adapter = await self._lora.load(request.lora_name, request.lora_path)
            return llm_pb2.LoadLoraAdapterResponse(model=await self._model_message(adapter))

        return await self._rpc(context, body)

    async def UnloadLoraAdapter(
        self, request: llm_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.UnloadLoraAdapterResponse:
        async def body() -> llm_pb2.UnloadLoraAdapterResponse:
            await self._lora.unload(request.lora_name)
            return llm_pb2.UnloadLoraAdapterResponse()

        return await self._rpc(context, body)

    async def Embed(
        self, request: llm_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> llm_pb2.EmbedResponse:
        async def body() -> llm_pb2.EmbedResponse:
            target = await self._lora.target(request.model)
            prepared = await embeddings.prepare(
                self._preparer,
                conv.embed_inputs(request),
                conv.embed_options(request),
                "inputs",
                lora=target.lora,  # under the adapter, if it names one
                tenant=current_tenant(),
            )
            await self._gate.admit(prepared)  # RESOURCE_EXHAUSTED over quota
            client_id, engine_id = _request_ids(request.request_id)
            self._checked(prepared.params)
            finals = await self._finals(prepared.requests(engine_id))
            return conv.embed_response(finals, client_id, target.name)

        return await self._rpc(context, body)

    # -- helpers ---------------------------------------------------------------------------

    async def model_card(self) -> dict[str, Any]:
        """{"id", "max_model_len", "created"} from LLMServer; fetched once (it never changes)."""
        return await self._client.model_card()

    async def _model_message(self, adapter: Adapter | None) -> llm_pb2.Model:
        """ListModels' entry of the served model (None) or of one of its adapters."""
        card = await self.model_card()
        model = llm_pb2.Model(
            id=card["id"],
            owned_by=OWNED_BY,
            created=int(card["created"]),
            max_model_len=int(card["max_model_len"]),
            root=card["id"],
        )
        if adapter is not None:
            model.id, model.parent, model.root = adapter.name, card["id"], adapter.path
        return model

    async def _prepare(
        self, request: llm_pb2.GenerateRequest, *, stream: bool
    ) -> tuple[GenerateRequest, conv.ResponseContext]:
        """The checked engine request (errors name the field) and how to answer it."""
        target = await self._lora.target(request.model)  # the model, or one of its adapters
        # "prompt" errors of the input check name the member the client set (see status_for).
        prepared = await self._preparer.prepare(
            conv.GenerateSource(request, stream=stream), lora=target.lora, tenant=current_tenant()
        )
        await self._gate.admit(prepared)  # RESOURCE_EXHAUSTED over the quota
        client_id, engine_id = _request_ids(request.request_id)
        self._checked(prepared.params)
        logprobs = request.HasField("logprobs")
        prompt_logprobs = request.HasField("prompt_logprobs")
        (llm_req,) = prepared.requests(engine_id)
        ctx = conv.ResponseContext(
            request_id=client_id,
            model=target.name,  # the name the client sent: an adapter's, if it named one
            top_logprobs=request.logprobs.top_logprobs if logprobs else 0,
            token_text=self._token_text if logprobs or prompt_logprobs else None,
            tools=prepared.tool_use,
            prompt_logprobs=request.prompt_logprobs if prompt_logprobs else None,
            prompt_token_ids=llm_req.input.prompt_token_ids if prompt_logprobs else (),
            reasoning=prepared.outputs.reasoning,  # a chat's, with a reasoning parser on
        )
        return llm_req, ctx

    async def _final(self, llm_req: GenerateRequest) -> RequestOutput:
        """The last (finished) output of one engine request."""
        last: RequestOutput | None = None
        outputs = self._gate.metered(self._client.generate(llm_req), llm_req)
        async with contextlib.aclosing(outputs) as outs:
            async for out in outs:
                last = out
        if last is None:
            raise KvrayError("the engine returned no output")
        return last

    async def _finals(self, llm_reqs: list[GenerateRequest]) -> list[RequestOutput]:
        """The final outputs of several engine requests run concurrently; the first failure
        cancels the others (which aborts their engine requests)."""
        return await gather_or_cancel([self._final(r) for r in llm_reqs])

    def _checked(self, params: Any) -> None:
        """Counts a request that passed the checks, by kind (kvray_router_requests_by_kind)."""
        if self._metrics is not None:
            self._metrics.checked("grpc", params)

    async def _rpc(
        self,
        context: grpc.aio.ServicerContext,
        body: Callable[[], Awaitable[T]],
        input_kind: str | None = None,
    ) -> T:
        code = grpc.StatusCode.OK
        try:
            self._auth.check(_metadata(context, "authorization"))
            bind_tenant(self._auth, None, _metadata_map(context))  # cluster/ingress/tenants.py
            remaining = context.time_remaining()
            async with asyncio.timeout(remaining):
                return await body()
        except asyncio.CancelledError:
            # The client cancelled, or the transport hit the deadline first.
            expired = (context.time_remaining() or 1.0) <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except TimeoutError:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            await context.abort(code, "deadline exceeded; the request was aborted")
        except grpc.aio.AbortError:
            raise  # context.abort() already set the status
        except Exception as exc:
            code, details = status_for(exc, input_kind)
            await context.abort(code, details)
        finally:
            self._count(code)
        raise AssertionError("unreachable: context.abort raises")

    def _count(self, code: grpc.StatusCode) -> None:
        if self._metrics is None:
            return
        self._metrics.request("grpc", code.name)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._metrics.rejected("queue_full")
        elif code is grpc.StatusCode.UNAUTHENTICATED:
            self._metrics.rejected("unauthenticated")


def _request_ids(requested: str) -> tuple[str, str]:
    """(the id responses echo, the engine's id): the client's id, or one chosen here. The
    engine's id is unique even when two clients send the same request_id."""
    client_id = requested or f"grpc-{uuid.uuid4().hex}"
    return client_id, f"{client_id}-{uuid.uuid4().hex[:8]}" if requested else client_id


def _metadata_map(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata (binary `-bin` values left out)."""
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None
