"""Request migration: a request whose replica dies continues on another, token-exact.

The ingress is the one place that sees every output a client gets, so it keeps what a resume
needs (`workers.frontend.resume.ResumeTracker`: per sample, the tokens and the length of the text
the
client already has). Nothing extra travels per token. When an attempt fails with
`EngineDeadError` (the engine process, a TP rank, the replica actor or its node died, or a
stopped replica's grace period ran out), `migrating` sends the request again:

- streamed: the prompt plus each unfinished sample's tokens so far (`EngineInput.resume`);
  the new engine re-prefills them (from its prefix cache where it holds them) and samples on
  from the same position, so greedy and seeded sampling go on exactly as if undisturbed, and
  the client sees one stream (no token lost or repeated, usage counting the whole request);
- not streamed (FINAL_ONLY): the client has nothing yet, so the request runs again from the
  start, which gives the same result for greedy and seeded sampling;
- unseeded sampling continues with fresh randomness (it was never reproducible).

The next attempt gets a new engine request id and names the replica it failed on
(`GenerateRequest.exclude_replicas`), which the routers pass over while another replica
lives. At most `max_migrations` moves per request, then the last error (HTTP 503 / gRPC
UNAVAILABLE) saying so: a request that itself kills engines cannot take every replica down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from cluster.errors import EngineDeadError
from workers.frontend.resume import ResumeTracker

if TYPE_CHECKING:
    from cluster.messages import GenerateRequest
    from workers.outputs import RequestOutput

logger = logging.getLogger("ray.serve.kvray.migration")

# Pause before attempt k + 1 (k >= 1): Serve's routers learn of a dead replica within a few
# hundred milliseconds; a short wait keeps a burst of migrations from landing on it meanwhile.
BACKOFF_S = (0.0, 0.25, 0.5, 1.0)

Attempt = Callable[["GenerateRequest"], AsyncIterator["RequestOutput"]]


async def migrating(
    attempt: Attempt,
    request: GenerateRequest,
    max_migrations: int,
    metrics: Any = None,
) -> AsyncIterator[RequestOutput]:
    """`attempt(request)`'s outputs, moved to another replica up to `max_migrations` times
    when it fails with EngineDeadError (module doc). `metrics`: RouterMetrics, or None."""
    tracker = ResumeTracker(request.input)
    current = request
    failed_at: float | None = None  # monotonic time of the failure not yet followed by a token
    prompt_scored = False  # a running output carried the prompt logprobs to the client
    while True:
        error: EngineDeadError | None = None
        try:
            async for out in attempt(current):
                if failed_at is not None and _has_tokens(out):
                    if metrics is not None:
                        metrics.migration_resumed(time.monotonic() - failed_at)
                    failed_at = None
                if out.prompt_logprobs is not None and not out.finished:
                    # A resumed attempt scores the prompt again: the client has it already.
                    if prompt_scored:
                        out = dataclasses.replace(out, prompt_logprobs=None)
                    prompt_scored = True
                yield tracker.observe(out)
            return
        except EngineDeadError as err:
            error = err
        if current.migration >= max_migrations:
            raise _exhausted(error, current.migration, max_migrations)
        resumed = tracker.resume_input()
        if resumed is None:  # every sample had finished; only the final output was lost
            yield tracker.final_output()
            return
        if failed_at is None:
            failed_at = time.monotonic()
        avoid = current.exclude_replicas | ({error.replica} if error.replica else set())
        current = dataclasses.replace(
            request,
            request_id=f"{request.request_id}-m{current.migration + 1}",
            input=resumed,
            sent_at=time.time(),  # its queue timeout starts again
            migration=current.migration + 1,
            exclude_replicas=frozenset(avoid),
        )
        logger.warning(
            "request %s: %s on replica %s after %d tokens; migrating (%d of at most %d)",
            request.request_id,
            error.cause,
            error.replica or "?",
            tracker.tokens_observed,
            current.migration,
            max_migrations,
        )
        if metrics is not None:
            metrics.migration(error.cause)
        await asyncio.sleep(BACKOFF_S[min(current.migration - 1, len(BACKOFF_S) - 1)])


def _exhausted(err: EngineDeadError, migrations: int, max_migrations: int) -> EngineDeadError:
    if max_migrations == 0:
        return err  # migration is off: the error as it was
    return EngineDeadError(
        f"the request failed on {migrations + 1} replicas (max_migrations={max_migrations}); "
        f"last error: {err.message}",
        cause=err.cause,
        replica=err.replica,
    )


def _has_tokens(out: RequestOutput) -> bool:
    return out.finished or any(c.delta_token_ids for c in out.outputs)
