"""Prefill/decode disaggregation, as the ingress runs it: one request, two replicas.

With prefill replicas (`--prefill-replicas`, cluster/config/pd.py), `Disaggregation.attempt`
takes the place of a plain call to the decode deployment (LLMServer). For a request the
policy disaggregates:

1. the prefill deployment (LLMServerPrefill) runs it capped at HANDOFF_TOKENS tokens,
   streamed (`GenerateRequest.handoff = "prefill"`): it computes the prompt's KV and samples
   the first token; the step after copies the prompt's full blocks out (an engine exports a
   block with the step after the one that filled it, workers/core/kv_share.py), and the
   replica publishes them to the cluster KV tier before its last output leaves
   (cluster/replica/llm_server.py);
2. a decode replica gets the request resumed from those tokens (`EngineInput.resume`, as a
   migration is, `handoff = "decode"`): it pulls the blocks from the tier instead of
   computing them, replays the tokens and generates the rest.

So the output is token-exact with one colocated replica (greedy and seeded sampling draw by
position; grammars, stop strings and penalties replay the first token; adapters, tenants
and priorities travel in the input). The client sees one stream: the prefill's token ids
(and logprobs) as soon as it returns them, their text with the decode replica's first output
(the prefill's text is not forwarded: capped, the prefill releases text a stop string could
still hold back). A request that finishes within those tokens ends at the prefill.

Kept local (straight to a decode replica), counted by reason: a resumed request (a migrated
one continues where it is), one that needs every prompt position (prompt logprobs, mean
pooling) or is an embedding, n > 1, max_tokens <= HANDOFF_TOKENS, a prompt with no room for
more tokens,
and in `auto` a request whose estimated cost is lower on a decode replica than disaggregated
(cluster/ingress/pd_cost.py: the delay each way adds to it and to the requests beside it,
from the replicas' live load, cached prefixes and measured rates). Until the routers have
seen the replicas, `auto` keeps a prompt that fits one engine step's token budget local
(it holds up the decode replica's streams for one step at most).

Failures: a prefill that fails before its tokens (its replica or engine died, a full queue,
a timeout) or ends aborted (out of KV cache there) falls back to the decode replica computing
the whole prompt; a decode replica
that found the blocks gone recomputes them (the tier never serves a wrong block). Both are
counted (`kvray_pd_fallback_total{reason}`), never silent. A decode replica that dies is a
migration like any other (cluster/ingress/migration.py sits above this).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from cluster.errors import KvrayError
from cluster.ingress.pd_cost import PdEstimate, ReplicaLoad, estimate
from cluster.ingress.pd_metrics import PdMetrics, ttft_phases
from workers.inputs import ResumedSample
from workers.outputs import CompletionOutput, RequestOutput, RequestOutputKind

if TYPE_CHECKING:
    from cluster.config import ServeConfig
    from cluster.messages import GenerateRequest
    from workers.inputs import EngineInput, InputChecker

logger = logging.getLogger("ray.serve.kvray.pd")

Attempt = Callable[["GenerateRequest"], AsyncIterator[RequestOutput]]
# The replicas of the decode and the prefill deployment for one input, as their routers see
# them (cluster/routing/replica_loads.py); None for a side whose router cannot tell yet.
Loads = Callable[["EngineInput"], tuple["list[ReplicaLoad] | None", "list[ReplicaLoad] | None"]]

# Tokens a prefill replica generates before the hand-off: the first, and one more step,
# which exports the prompt's last full blocks (module doc).
HANDOFF_TOKENS = 2


@dataclasses.dataclass(frozen=True)
class PdPolicy:
    """Which requests go to a prefill replica first (module doc)."""

    mode: str  # "always" | "auto" ("off" never builds one)
    step_tokens: int  # one engine step's prompt-token budget (auto's bound)
    block_size: int

    @staticmethod
    def from_config(config: ServeConfig) -> PdPolicy | None:
        if not config.pd.enabled:
            return None
        from workers.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

        e = config.engine
        step = e.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, e.block_size)
        return PdPolicy(config.pd.pd, step, e.block_size)

    def decide(
        self,
        inp: EngineInput,
        max_model_len: int,
        cost: Callable[[], PdEstimate | None] | None = None,
    ) -> str:
        """ "disaggregated", or the reason the request stays on a decode replica. `cost`:
        auto's estimate both ways, asked for only when auto needs it (None, or it returns
        None: not known yet, the step-budget rule decides)."""
        p = inp.params
        if inp.resume:
            return "resumed"
        if p.needs_every_prompt_position or p.pooling is not None or p.n > 1:
            return "unsupported"
        prompt = len(inp.prompt_token_ids)
        room = prompt + HANDOFF_TOKENS < max_model_len
        if (p.max_tokens is not None and p.max_tokens <= HANDOFF_TOKENS) or not room:
            return "no_room"
        if self.mode == "auto":
            est = cost() if cost is not None else None
            if est is not None:
                return "disaggregated" if est.disaggregate else "cheaper_local"
            if prompt <= self.step_tokens:
                return "short"
        return "disaggregated"


class Disaggregation:
    """One ingress replica's side of disaggregation: `attempt` replaces the plain call to
    the decode deployment in LLMClient (module doc)."""

    def __init__(
        self,
        policy: PdPolicy,
        prefill: Attempt,
        decode: Attempt,
        checker: Callable[[], Awaitable[InputChecker]],
        metrics: Any = None,
        loads: Loads | None = None,
    ) -> None:
        # prefill / decode: one call to the prefill / decode deployment (LLMClient's).
        # checker: the served model's limits (LLMClient.input_checker).
        # metrics: cluster/ingress/pd_metrics.PdMetrics, or None (unit use).
        # loads: both deployments' replicas for auto's estimate (None: the step-budget rule).
        self.policy = policy
        self._prefill = prefill
        self._decode = decode
        self._checker = checker
        self.metrics = metrics
        self._loads = loads
        # Prompt tokens this ingress sent to prefill replicas that have not returned yet: the
        # replicas' stats show them a stats period late, and a burst arrives within one.
        self._prefilling = 0

    def estimate(self, inp: EngineInput) -> PdEstimate | None:
        """auto's estimate for `inp` both ways (cluster/ingress/pd_cost.py); None while
        either deployment's router cannot tell."""
        if self._loads is None:
            return None
        decode, prefill = self._loads(inp)
        if not decode or not prefill:
            return None
        if self._prefilling:  # spread over the prefill replicas, as their router does
            share = self._prefilling // len(prefill)
            prefill = [
                dataclasses.replace(p, queued_tokens=max(p.queued_tokens, share)) for p in prefill
            ]
        prompt = len(inp.prompt_token_ids)
        est = estimate(
            prompt,
            decode,
            prefill,
            block_size=self.policy.block_size,
            handoff_tokens=HANDOFF_TOKENS,
        )
        if est is not None:
            logger.debug(
                "%d-token prompt: ~%.1f ms of delay on a decode replica, ~%.1f ms disaggregated",
                prompt,
                est.local_s * 1e3,
                est.pd_s * 1e3,
            )
        return est

    async def attempt(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        inp = request.input
        checker = await self._checker()
        decision = self.policy.decide(inp, checker.max_model_len, lambda: self.estimate(inp))
        self._count("decided", decision)
        if decision != "disaggregated":
            async for out in self._decode(request):
                yield out
            return
        t0 = time.monotonic()
        prompt = len(inp.prompt_token_ids)
        self._prefilling += prompt
        try:
            first = await self._first_token(request)
        finally:
            self._prefilling -= prompt
        if first is None:  # the prefill failed: this replica computes it all
            async for out in self._decode(request):
                yield out
            return
        prefill_s = time.monotonic() - t0
        self._count("handed_off", prefill_s)
        c = first.outputs[0]
        if c.finish_reason != "length":  # it stopped before the cap: nothing to decode
            # The client has none of it yet: the deltas are the whole of it.
            whole = dataclasses.replace(
                c, delta_text=c.text, delta_token_ids=list(c.token_ids), delta_logprobs=c.logprobs
            )
            yield dataclasses.replace(first, request_id=request.request_id, outputs=[whole])
            return
        tokens = list(c.token_ids)
        logprobs = list(c.logprobs) if c.logprobs is not None else None
        if inp.params.output_kind is RequestOutputKind.DELTA:
            # The token now; its text comes with the decode replica's first output (module doc).
            delta = CompletionOutput(index=0, delta_token_ids=tokens, delta_logprobs=logprobs)
            yield RequestOutput(request.request_id, inp.prompt, list(inp.prompt_token_ids), [delta])
        resumed = ResumedSample(0, tuple(tokens), 0, tuple(logprobs) if logprobs else None)
        decode = dataclasses.replace(
            request, handoff="decode", input=dataclasses.replace(inp, resume=(resumed,))
        )
        # The prompt's full blocks, published by the prefill replica: what the decode replica
        # should find cached once it pulled them.
        bs = self.policy.block_size
        handed = len(inp.prompt_token_ids) // bs * bs
        t1, first_s = time.monotonic(), None
        # Streamed, the decode replica's first output is its first token (not so the one
        # output of a request that is not): the TTFT's phases are measured on those.
        streamed = inp.params.output_kind is RequestOutputKind.DELTA
        async for out in self._decode(decode):
            if first_s is None:
                first_s = time.monotonic() - t1
            if streamed and out.finished and out.metrics is not None:
                phases = ttft_phases(first, prefill_s, out, first_s)
                if phases is not None:
                    self._count("ttft", phases)
            if out.finished and out.metrics is not None and out.num_cached_tokens < handed:
                self._count("fallback", "pull_missed")
                logger.info(
                    "request %s: the decode replica computed %d of %d handed-off prompt tokens",
                    request.request_id,
                    handed - out.num_cached_tokens,
                    handed,
                )
            yield out

    async def _first_token(self, request: GenerateRequest) -> RequestOutput | None:
        """The prefill replica's finished output, or None when it failed."""
        inp = request.input
        params = inp.params.derived(max_tokens=HANDOFF_TOKENS, output_kind=RequestOutputKind.DELTA)
        prefill = dataclasses.replace(
            request,
            request_id=f"{request.request_id}-prefill",
            handoff="prefill",
            input=dataclasses.replace(inp, params=params),
        )
        last = None
        try:
            async for out in self._prefill(prefill):
                last = out
        except KvrayError as err:
            if last is None or not last.finished:
                self._fallback(request, f"{type(err).__name__}: {err}")
                return None
        if last is None or not last.finished or not last.outputs[0].token_ids:
            self._fallback(request, "the prefill ended without a token")
            return None
        c = last.outputs[0]
        if c.finish_reason not in ("stop", "length"):  # aborted there (e.g. out of KV cache)
            self._fallback(request, f"the prefill ended with {c.finish_reason} ({c.stop_reason})")
            return None
        return last

    def _fallback(self, request: GenerateRequest, why: str) -> None:
        self._count("fallback", "prefill_failed")
        logger.warning(
            "request %s: prefill replica failed (%s); the decode replica computes the prompt",
            request.request_id,
            why,
        )

    def _count(self, what: str, value: Any) -> None:
        if self.metrics is not None:
            getattr(self.metrics, what)(value)


def pd_client_kwargs(config: ServeConfig, prefill: Any) -> dict[str, Any]:
    """LLMClient's disaggregation keywords for an ingress of `config`, whose prefill
    deployment's handle is `prefill` (None: the application has none): none when off."""
    policy = PdPolicy.from_config(config)
    if policy is None or prefill is None:
        return {}
    return {"prefill": prefill, "pd": policy, "pd_metrics": PdMetrics()}
