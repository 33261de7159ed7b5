"""The replica's side of the cluster KV tier (`--kv-share-gib`): it publishes the KV blocks
its engine computes to Ray's object store, and pulls the blocks of a prompt a peer computed
when that is cheaper than computing them.

Publish: the engine exports every full block it computes, once (workers/core/kv_share.py),
and hands the copies over with its KV events (`BlocksExported`). A thread here sends them to
this node's store actor (cluster/replica/kv_store.py), which puts them into Ray's object
store (owning them, so they outlive this replica) and announces them to the application's
directory (cluster/replica/kv_directory.py, which bounds the store). Nothing waits on it:
when the store or the queue is full, blocks are dropped (counted) and peers recompute.

Pull: before a request enters the engine, its prompt's block hashes (plus a resumed
sample's outputs: a migrated request's context) are chained as the engine does. Past the
run this engine's device cache holds (mirrored from its KV events), the directory says
which of the following blocks are published; the cost model (cluster/replica/kv_cost.py)
compares pulling their bytes with computing their tokens, both rates measured here. A pull
reads the objects (a borrowed reference keeps each alive meanwhile), checks every block
(layout key, hash, tokens, the chain over its parent and adapter salt; a failure ends the
run, counted as refused), and the request carries them to the engine
(`EngineInput.kv_blocks`), which checks them again and restores them from its host tier.
Anything that goes wrong (a lost object, a dead owner, a timeout) leaves the request as it
was: it recomputes, never a wrong token. Each decision is logged at debug and counted
(`kvray_kv_share_pulls_total{outcome}`).

Learning: a finished request that computed its prompt gives the prefill rate; one that
pulled gives the pull's whole cost, the fetch timed here plus the engine's part (the blocks
entering its host tier and copied to the device: its time to the first token less what the
rest of the prompt took to compute), so the model compares what the request waits for.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cluster.replica.kv_cost import PullCost
from workers.core.block_hash import chain_hash, prompt_block_hashes
from workers.core.kv_events import AllBlocksCleared, BlockRemoved, BlocksExported, BlockStored
from workers.messages.kv_blocks import KvBlockData

if TYPE_CHECKING:
    from cluster.config import ServeConfig
    from cluster.replica.kv_share_metrics import KvShareMetrics
    from workers.config import EngineArgs
    from workers.core.kv_events import KvEvent
    from workers.inputs import EngineInput
    from workers.outputs import RequestOutput

logger = logging.getLogger("ray.serve.kvray.kv_share")

GIB = 1 << 30
# Batches of exported blocks waiting for the publishing thread; more are dropped.
MAX_QUEUED_BATCHES = 256
# A lookup or a pull that takes longer than this is abandoned: the request recomputes.
PULL_TIMEOUT_S = 10.0
# A batch the node's store has not taken by then counts as dropped.
PUBLISH_TIMEOUT_S = 30.0
# Outcomes of a request's pull decision (the metric's `outcome` label).
OUTCOMES = ("pulled", "recompute", "miss", "failed")
# A prefill replica's hand-off waits this long at most for its blocks to be published, polling.
FLUSH_TIMEOUT_S = 5.0
FLUSH_POLL_S = 0.002
# Pulls whose request has not finished yet, kept for the cost model; the oldest beyond this
# (requests that never finish: aborted, cancelled) are forgotten.
MAX_PENDING_PULLS = 4096


class KvShare:
    def __init__(
        self,
        directory: Any,
        store: Any,
        layout: str,
        block_size: int,
        block_bytes: int,
        metrics: KvShareMetrics | None = None,
        cost: PullCost | None = None,
    ) -> None:
        self.directory = directory
        self.store = store  # this node's store actor (cluster/replica/kv_store.py)
        self.layout = layout
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block over every rank
        self.metrics = metrics
        self.cost = cost or PullCost()
        self._lock = threading.Lock()
        self._mirror: set[int] = set()  # the engine's device-cached hashes
        self._queue: queue.Queue[tuple[KvBlockData, ...] | None] = queue.Queue(MAX_QUEUED_BATCHES)
        # Batches handed to the publishing thread, and those it has finished (`flushed`).
        self._enqueued = self._processed = 0
        self._thread = threading.Thread(target=self._publish_forever, daemon=True, name="kv-share")
        self._thread.start()
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.published = self.dropped = self.refused = self.pulled_blocks = 0
        # request id -> (bytes pulled, seconds the fetch took): completed at its first token.
        self._pending: OrderedDict[str, tuple[int, float]] = OrderedDict()

    # -- the engine's events (its core's thread) ---------------------------------------------
    def on_events(self, events: tuple[KvEvent, ...]) -> None:
        with self._lock:
            for ev in events:
                if isinstance(ev, BlockStored):
                    self._mirror.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    self._mirror.difference_update(ev.block_hashes)
                elif isinstance(ev, AllBlocksCleared):
                    self._mirror.clear()
        for ev in events:
            if isinstance(ev, BlocksExported):
                try:
                    self._queue.put_nowait(ev.blocks)
                    self._enqueued += 1
                except queue.Full:
                    self._count_dropped(len(ev.blocks))

    def listen(self, engine: Any) -> None:
        """Follows `engine`'s KV events, after the listener it has (the router's publisher,
        cluster/replica/kv_publish.py), and forgets the last engine's cache."""
        with self._lock:
            self._mirror.clear()
        before = engine.kv_listener

        def both(events: tuple[KvEvent, ...]) -> None:
            if before is not None:
                before(events)
            self.on_events(events)

        engine.kv_listener = both

    def close(self) -> None:
        self._queue.put(None)

    def _publish_forever(self) -> None:
        while (blocks := self._queue.get()) is not None:
            self._publish(blocks)
            # At TP > 1 the blocks are views of the ranks' replies in Ray's object store: a
            # reference kept here until the next batch came would pin those objects.
            del blocks

    def _publish(self, blocks: tuple[KvBlockData, ...]) -> None:
        try:  # waits, so that at most one batch is on its way to the store
            # Through a future: ray.get in an async actor's process warns, whichever thread.
            # The call's reference is a temporary, gone with this statement: while one is
            # held, Ray keeps its argument (the blocks' copy in the object store) for
            # lineage.
            put = self.store.put.remote
            n = put(self.layout, list(blocks)).future().result(timeout=PUBLISH_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - the store actor gone, slow: peers recompute
            logger.debug("%d KV blocks not published: %s", len(blocks), err)
            n = 0
        self.published += n
        if self.metrics is not None and n:
            self.metrics.published(n)
        if n < len(blocks):
            self._count_dropped(len(blocks) - n)
        self._processed += 1

    def _count_dropped(self, n: int) -> None:
        self.dropped += n
        if self.metrics is not None:
            self.metrics.dropped(n)

    # -- pulls (the replica's event loop) ----------------------------------------------------
    def _context(self, inp: EngineInput) -> list[int]:
        """The tokens whose KV the request starts from: the prompt, and a lone resumed
        sample's outputs (a migrated request continues from both)."""
        ids = list(inp.prompt_token_ids)
        if len(inp.resume) == 1:
            ids += inp.resume[0].output_token_ids
        return ids

    async def flushed(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Waits until every batch of blocks handed to the publishing thread so far is
        published (or dropped), at most `timeout_s`: a prefill replica's hand-off, whose
        decode replica looks the prompt's blocks up next. Whether they all were."""
        await asyncio.sleep(0)  # the engine's KV events of the step that just ended
        target, deadline = self._enqueued, time.monotonic() + timeout_s
        while self._processed < target:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(FLUSH_POLL_S)
        return True

    async def attach(
        self, inp: EngineInput, request_id: str | None = None, handoff: str | None = None
    ) -> EngineInput:
        """`inp`, with the published blocks of its prompt when pulling them is cheaper than
        computing them; `inp` as it is otherwise (module doc). `request_id`: the id it runs
        under, so that its finished output completes the pull's cost (`observe_finished`);
        without one the fetch alone is learned. `handoff` "decode": a prefill replica
        computed them for this request (cluster/ingress/pd.py): pulled whatever the cost."""
        if inp.params.needs_every_prompt_position or len(inp.resume) > 1:
            return inp
        forced = handoff == "decode"
        ids, bs = self._context(inp), self.block_size
        salt = None if inp.lora is None else inp.lora.lora_int_id
        hashes = prompt_block_hashes(ids, bs, len(ids), salt)
        with self._lock:
            local = next((i for i, h in enumerate(hashes) if h not in self._mirror), len(hashes))
        if local == len(hashes):
            return inp  # all on the device already (or no full block)
        missing = len(hashes) - local
        if not forced and not self.cost.worth_looking_up(missing * bs, missing * self.block_bytes):
            why = f"{missing} blocks compute faster than a lookup and a pull would take"
            return self._decided(inp, "recompute", why)
        t0 = time.perf_counter()
        try:
            found = await asyncio.wait_for(
                self.directory.lookup.remote(self.layout, hashes[local:]), PULL_TIMEOUT_S
            )
        except Exception as err:  # noqa: BLE001 - the directory restarting, gone: recompute
            return self._decided(inp, "failed", f"lookup failed: {err}")
        t1 = time.perf_counter()
        self.cost.observe_lookup(t1 - t0)
        if not found:
            return self._decided(inp, "miss", f"{missing} blocks not published")
        # From here the lookup is spent either way: pulling is weighed without it.
        tokens, nbytes = len(found) * bs, len(found) * self.block_bytes
        if not forced and not self.cost.worth_pulling(tokens, nbytes):
            why = (
                f"pull {len(found)} blocks ~{self.cost.pull_seconds(nbytes) * 1e3:.1f} ms >= "
                f"compute {tokens} tokens ~{self.cost.compute_seconds(tokens) * 1e3:.1f} ms"
            )
            return self._decided(inp, "recompute", why)
        try:
            payloads = await asyncio.wait_for(
                asyncio.gather(*(ref for (ref,) in found)), PULL_TIMEOUT_S
            )
        except Exception as err:  # noqa: BLE001 - lost with its node, evicted, timed out
            return self._decided(inp, "failed", f"pull of {len(found)} blocks failed: {err}")
        blocks = self._checked(payloads, hashes[local:], ids, local, salt)
        done = time.perf_counter()
        seconds = done - t1  # the fetch and the checks: what the cost model weighs
        if not blocks:
            return self._decided(inp, "failed", "no pulled block passed its checks")
        pulled = sum(b.num_bytes for b in blocks)
        if request_id is None:
            self.cost.observe_pull(pulled, seconds)
        else:
            self._pending[request_id] = (pulled, seconds)
            while len(self._pending) > MAX_PENDING_PULLS:
                self._pending.popitem(last=False)
        self.pulled_blocks += len(blocks)
        if self.metrics is not None:
            self.metrics.pulled(len(blocks) * bs, done - t0)  # the lookup too
        why = f"{len(blocks)} blocks ({pulled} bytes) in {(done - t0) * 1e3:.1f} ms"
        return self._decided(replace(inp, kv_blocks=tuple(blocks)), "pulled", why)

    def _checked(
        self, payloads: list, hashes: list[int], ids: list[int], start: int, salt: int | None
    ) -> list[KvBlockData]:
        """The pulled blocks up to the first that fails a check (counted as refused)."""
        bs, out = self.block_size, []
        for k, (layout, b) in enumerate(payloads):
            i = start + k
            ok = (
                layout == self.layout
                and isinstance(b, KvBlockData)
                and b.block_hash == hashes[k]
                and b.salt == salt
                and b.token_ids == tuple(ids[i * bs : (i + 1) * bs])
                and b.num_bytes == self.block_bytes
                and chain_hash(b.parent_hash, b.token_ids, b.salt) == b.block_hash
            )
            if not ok:
                self.refused += 1
                if self.metrics is not None:
                    self.metrics.refused(1)
                logger.warning("refused a pulled KV block (position %d): it fails a check", i)
                break
            out.append(b)
        return out

    def _decided(self, inp: EngineInput, outcome: str, why: str) -> EngineInput:
        self.outcomes[outcome] += 1
        if self.metrics is not None:
            self.metrics.decided(outcome)
        logger.debug("KV pull decision: %s (%s)", outcome, why)
        return inp

    def stats(self) -> dict[str, Any]:
        """This replica's side of the tier so far (replica_stats: tests, benches)."""
        return {
            **self.outcomes,
            "published": self.published,
            "dropped": self.dropped,
            "refused": self.refused,
            "pulled_blocks": self.pulled_blocks,
            "pull_bytes_per_s": self.cost.pull_bytes_per_s,
            "pull_overhead_s": self.cost.pull_overhead_s,
            "lookup_s": self.cost.lookup_s,
            "prefill_tokens_per_s": self.cost.prefill_tokens_per_s,
            "prefill_fixed_s": self.cost.prefill_fixed_s,
        }

    def rates(self) -> dict[str, float]:
        """This replica's measured figures, in its routing stats: what the ingresses weigh
        when they choose whether to disaggregate a request (cluster/ingress/pd_cost.py)."""
        c = self.cost
        return {
            "prefill_tokens_per_s": c.prefill_tokens_per_s,
            "step_s": c.prefill_fixed_s,  # 0 until measured: the estimate's prior then
            "pull_bytes_per_s": c.pull_bytes_per_s,
            "pull_overhead_s": c.pull_overhead_s,
            "kv_bytes_per_token": self.block_bytes // self.block_size,
        }

    def observe_finished(self, out: RequestOutput) -> None:
        """A finished request's figures, for the cost model (module doc): the prefill rate
        of one that computed its prompt, the whole cost of a pull."""
        pull = self._pending.pop(out.request_id, None)
        m = out.metrics
        if m is None or m.first_token_time is None or m.first_scheduled_time is None:
            return
        computed = m.num_prompt_tokens - m.num_cached_tokens
        engine_s = m.first_token_time - m.first_scheduled_time
        if pull is None:
            self.cost.observe_prefill(computed, engine_s)
            return
        nbytes, fetch_s = pull
        restore_s = max(0.0, engine_s - self.cost.first_token_seconds(computed))
        self.cost.observe_pull(nbytes, fetch_s + restore_s)


def replica_kv_share(config: ServeConfig, args: EngineArgs, metrics: Any) -> KvShare | None:
    """The replica's side of the tier, with its application's directory; None when off."""
    gib = config.engine.kv_share_gib
    if not gib:
        return None
    from ray import serve

    from cluster.replica.kv_directory import directory_actor
    from cluster.replica.kv_store import node_store
    from workers.kv_layout import kv_block_bytes, kv_layout_key

    engine = args.create_config()
    tp = engine.parallel.tensor_parallel_size
    app = serve.get_replica_context().app_name
    directory = directory_actor(app, int(gib * GIB))
    share = KvShare(
        directory,
        node_store(app, directory),
        kv_layout_key(engine),
        engine.cache.block_size,
        kv_block_bytes(engine, tp) * tp,
        metrics,
    )
    logger.info("cluster KV tier on: %g GiB shared in the object store (app %s)", gib, app)
    return share
