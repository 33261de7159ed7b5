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

A migration is charged only when a replica took the request and failed. A replica that turns
it away before anything ran (its engine is dead or restarting: `EngineDeadError.taken` is
False), or no replica to send it to at all, costs nothing: the request waits and tries again
(backing off up to `WAIT_POLL_S`) until a replica takes it, for at most `queue_timeout_s`
from when it was sent (then 503 + Retry-After, as any queue timeout). So streams caught by
two faults close together, with no healthy replica for a while, wait for a replica to come
back instead of spending their migrations on replicas known dead.

A replica that refuses a request because its waiting queue is full (`QueueFullError` naming
the replica: nothing ran) is likewise passed over at once, uncharged: the request goes to
another replica, which the routers send it to while one has room. The routers avoid full
replicas themselves, but each ingress replica routes on its own and two can fill one queue at
the same moment. The 429 comes only once a replica already passed over refuses too: the
router had no other with room.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from cluster.errors import EngineDeadError, QueueFullError, QueueTimeoutError
from cluster.tracing import migration_event
from workers.frontend.resume import ResumeTracker

if TYPE_CHECKING:
    from cluster.messages import GenerateRequest
    from workers.outputs import RequestOutput

logger = logging.getLogger("ray.serve.kvray.migration")

# Pause before attempt k + 1 (k >= 1): Serve's routers learn of a dead replica within a few
# hundred milliseconds; a short wait keeps a burst of migrations from landing on it meanwhile.
BACKOFF_S = (0.0, 0.25, 0.5, 1.0)
# Waiting for a replica that can take the request: the first retry at once, then each pause
# twice the last, up to this.
WAIT_POLL_S = 1.0
# Causes of an EngineDeadError raised before any replica had the request: Serve has no
# healthy replica to route it to (cluster.errors.as_kvray_error). An unreachable replica
# ("replica_unavailable") may have been running it, so that one is charged.
NOT_TAKEN_CAUSES = frozenset({"no_replica"})

Attempt = Callable[["GenerateRequest"], AsyncIterator["RequestOutput"]]


async def migrating(
    attempt: Attempt,
    request: GenerateRequest,
    max_migrations: int,
    metrics: Any = None,
    queue_timeout_s: float | None = None,
) -> AsyncIterator[RequestOutput]:
    """`attempt(request)`'s outputs, moved to another replica up to `max_migrations` times
    when it fails with EngineDeadError (module doc). `metrics`: RouterMetrics, or None.
    `queue_timeout_s`: how long a request may wait for a replica to take it (None or 0: as
    long as it takes)."""
    tracker = ResumeTracker(request.input)
    current = request
    failed_at: float | None = None  # monotonic time of the failure not yet followed by a token
    prompt_scored = False  # a running output carried the prompt logprobs to the client
    pause = 0.0  # the next wait for a replica that can take the request
    while True:
        error: EngineDeadError | None = None
        received = False  # this attempt yielded something: a replica took it
        try:
            async for out in attempt(current):
                received = True
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
        except QueueFullError as err:
            if received or err.replica is None or err.replica in current.exclude_replicas:
                raise  # Serve's own queue cap, or every replica with room was tried
            current = dataclasses.replace(
                current, exclude_replicas=current.exclude_replicas | {err.replica}
            )
            continue
        if not received and _not_taken(error):
            # Nothing ran: wait for a replica that can take it, uncharged (module doc).
            if queue_timeout_s and time.time() - current.sent_at >= queue_timeout_s:
                raise _no_replica_in_time(error, queue_timeout_s)
            avoid = current.exclude_replicas | ({error.replica} if error.replica else set())
            current = dataclasses.replace(current, exclude_replicas=frozenset(avoid))
            await asyncio.sleep(pause)
            pause = min(WAIT_POLL_S, max(0.1, 2 * pause))
            continue
        pause = 0.0
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
        migration_event(request, error, current.migration, tracker.tokens_observed)
        if metrics is not None:
            metrics.migration(error.cause)
        await asyncio.sleep(BACKOFF_S[min(current.migration - 1, len(BACKOFF_S) - 1)])


def _not_taken(err: EngineDeadError) -> bool:
    return not getattr(err, "taken", True) or err.cause in NOT_TAKEN_CAUSES


def _no_replica_in_time(err: EngineDeadError, queue_timeout_s: float) -> QueueTimeoutError:
    return QueueTimeoutError(
        f"no engine replica could take the request within queue_timeout_s "
        f"({queue_timeout_s:g} s); last: {err.message}",
        retry_after_s=max(1, round(queue_timeout_s / 4)),
    )


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
